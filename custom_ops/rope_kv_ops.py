"""Rotary embedding of a step's queries and keys fused with the paged KV write: one kernel.

Per layer a decoder step rotates ``q`` and ``k`` (RoPE, the neox layout: the rotated part of a
head is two halves that turn together) and then stores ``k`` and ``v`` at the step's slots of the
layer's KV cache. Done apart, that is two launches per layer (flashinfer's
``apply_rope_with_cos_sin_cache_inplace`` and :func:`custom_ops.kv_cache_ops.write_kv_cache`);
at small batches each costs a few microseconds of GPU time for almost no work, so a 30-layer
step pays for 30 launches it need not make. Here one Triton program per token loads the token's
cos/sin row once, rotates all its query and key heads in place, and writes the rotated key and
the value to the token's slot (nothing for a padding row, slot < 0).

The cos/sin cache is flashinfer's layout (``RotaryEmbedding.cos_sin_cache``): float32
``[max_position, rotary_dim]``, the cosines of the ``rotary_dim / 2`` frequencies, then their
sines; the rotation is computed in float32 and rounded once to the tensors' dtype, as flashinfer
does. Features past ``rotary_dim`` pass through unrotated (partial rotary). vLLM fuses the same
two steps for its MLA and fp8 paths, and flashinfer 0.5.3 only for fp8 MLA
(``rope_quantize_fp8_append_paged_kv_cache``); neither covers a bf16 GQA cache with a flat slot
mapping, hence this kernel.
"""

from __future__ import annotations

import torch

from custom_ops.kv_cache_ops import write_kv_cache_torch

try:  # Triton ships with CUDA builds of torch; CPU CI has none and uses the reference.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installed torch build
    triton = None
    tl = None

__all__ = ["rope_and_write_kv", "rope_and_write_kv_torch", "rope_and_write_kv_triton"]


def _check_args(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    head_dim: int,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[int, int, int]:
    """Validate shapes; returns ``(num_tokens, num_heads, num_kv_heads)``."""
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2 or kv_cache.shape[4] != head_dim:
        raise ValueError(
            f"kv_cache must be [num_blocks, 2, block_size, num_kv_heads, head_dim={head_dim}], "
            f"got {tuple(kv_cache.shape)}"
        )
    num_kv_heads = kv_cache.shape[3]
    num_tokens = q.shape[0]
    if q.dim() != 2 or q.shape[1] % head_dim:
        raise ValueError(f"q must be [T, num_heads * {head_dim}], got {tuple(q.shape)}")
    for name, x in (("k", k), ("v", v)):
        if tuple(x.shape) != (num_tokens, num_kv_heads * head_dim):
            raise ValueError(
                f"{name} must be [T={num_tokens}, {num_kv_heads * head_dim}], got {tuple(x.shape)}"
            )
    if tuple(positions.shape) != (num_tokens,):
        raise ValueError(f"positions must be [T={num_tokens}], got {tuple(positions.shape)}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] < num_tokens:
        raise ValueError(
            f"slot_mapping must be 1-D with at least {num_tokens} entries, "
            f"got {tuple(slot_mapping.shape)}"
        )
    rotary_dim = cos_sin_cache.shape[-1] if cos_sin_cache.dim() == 2 else -1
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(
            f"cos_sin_cache must be [max_position, rotary_dim] with an even rotary_dim <= "
            f"head_dim={head_dim}, got {tuple(cos_sin_cache.shape)}"
        )
    return num_tokens, q.shape[1] // head_dim, num_kv_heads


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """neox rotation of ``x [T, heads, head_dim]`` by float32 ``cos``/``sin [T, 1, rotary_dim/2]``,
    computed in float32 and rounded once to ``x``'s dtype."""
    half = rotary_dim // 2
    xf = x.float()
    x1, x2, rest = xf[..., :half], xf[..., half:rotary_dim], xf[..., rotary_dim:]
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)
    return out.to(x.dtype)


def rope_and_write_kv_torch(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    head_dim: int,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`rope_and_write_kv_triton` in plain PyTorch (CPU, and the tests).

    ``q`` and ``k`` are rotated **in place** (as the kernel does) and returned; the rotated ``k``
    and ``v`` are stored at ``slot_mapping`` of ``kv_cache``. Arguments and errors as
    :func:`rope_and_write_kv_triton`. Not capturable in a CUDA graph (the KV write selects the
    valid rows on the host).
    """
    num_tokens, num_heads, num_kv_heads = _check_args(
        positions, q, k, v, head_dim, cos_sin_cache, kv_cache, slot_mapping
    )
    rotary_dim = cos_sin_cache.shape[-1]
    cs = cos_sin_cache[positions].float().unsqueeze(1)  # [T, 1, rotary_dim]
    cos, sin = cs[..., : rotary_dim // 2], cs[..., rotary_dim // 2 :]
    q.copy_(_rotate(q.view(num_tokens, num_heads, head_dim), cos, sin, rotary_dim).flatten(1))
    k.copy_(_rotate(k.view(num_tokens, num_kv_heads, head_dim), cos, sin, rotary_dim).flatten(1))
    write_kv_cache_torch(k, v, kv_cache, slot_mapping)
    return q, k


if triton is not None:

    @triton.jit
    def _rope_write_kv_kernel(
        pos_ptr,  # int64 [T]
        q_ptr,  # [T, H * D] rows q_stride apart
        k_ptr,  # [T, KV * D] rows k_stride apart
        v_ptr,  # [T, KV * D] rows v_stride apart
        cos_sin_ptr,  # float32 [max_position, ROT], rows cos_sin_stride apart
        cache_ptr,  # [num_blocks, 2, block_size, KV * D], inner row contiguous
        slot_ptr,  # int64 [>= T]
        q_stride,
        k_stride,
        v_stride,
        cos_sin_stride,
        cache_block_stride,
        cache_kv_stride,
        cache_slot_stride,
        block_size,
        NUM_HEADS: tl.constexpr,
        NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HALF: tl.constexpr,  # rotary_dim // 2
        HALF_P2: tl.constexpr,  # next power of two of HALF
        HEADS_P2: tl.constexpr,  # next power of two of NUM_HEADS
        KV_HEADS_P2: tl.constexpr,
        PASS: tl.constexpr,  # HEAD_DIM - 2 * HALF, features that do not rotate
        PASS_P2: tl.constexpr,
        ROW_P2: tl.constexpr,  # next power of two of NUM_KV_HEADS * HEAD_DIM
        PDL: tl.constexpr,  # launched as a programmatic dependent launch (sm90+)
    ):
        if PDL:  # as custom_ops.skinny_gemm: the next kernel may launch; wait for the last one
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        token = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + token)
        j = tl.arange(0, HALF_P2)
        jm = j < HALF
        cos = tl.load(cos_sin_ptr + pos * cos_sin_stride + j, mask=jm, other=0.0)[None, :]
        sin = tl.load(cos_sin_ptr + pos * cos_sin_stride + HALF + j, mask=jm, other=0.0)[None, :]

        # Queries: rotate every head's two halves in place.
        h = tl.arange(0, HEADS_P2)[:, None]
        m = (h < NUM_HEADS) & jm[None, :]
        base = q_ptr + token * q_stride + h * HEAD_DIM + j[None, :]
        x1 = tl.load(base, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF, mask=m, other=0.0).to(tl.float32)
        tl.store(base, (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty), mask=m)
        tl.store(base + HALF, (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty), mask=m)

        # Keys: the same, and the rotated halves also go to the cache slot.
        slot = tl.load(slot_ptr + token)
        keep = slot >= 0
        slot = tl.maximum(slot, 0)
        dst = cache_ptr + (slot // block_size) * cache_block_stride
        dst += (slot % block_size) * cache_slot_stride
        h = tl.arange(0, KV_HEADS_P2)[:, None]
        m = (h < NUM_KV_HEADS) & jm[None, :]
        off = h * HEAD_DIM + j[None, :]
        base = k_ptr + token * k_stride + off
        x1 = tl.load(base, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF, mask=m, other=0.0).to(tl.float32)
        o1 = (x1 * cos - x2 * sin).to(k_ptr.dtype.element_ty)
        o2 = (x2 * cos + x1 * sin).to(k_ptr.dtype.element_ty)
        tl.store(base, o1, mask=m)
        tl.store(base + HALF, o2, mask=m)
        tl.store(dst + off, o1.to(cache_ptr.dtype.element_ty), mask=m & keep)
        tl.store(dst + off + HALF, o2.to(cache_ptr.dtype.element_ty), mask=m & keep)
        if PASS > 0:  # partial rotary: the rest of each key head is copied as it is
            p = tl.arange(0, PASS_P2)
            pm = (h < NUM_KV_HEADS) & (p < PASS)[None, :]
            off = h * HEAD_DIM + 2 * HALF + p[None, :]
            rest = tl.load(k_ptr + token * k_stride + off, mask=pm, other=0.0)
            tl.store(dst + off, rest.to(cache_ptr.dtype.element_ty), mask=pm & keep)

        # Values: copied to the cache slot.
        c = tl.arange(0, ROW_P2)
        cm = (c < NUM_KV_HEADS * HEAD_DIM) & keep
        val = tl.load(v_ptr + token * v_stride + c, mask=cm, other=0.0)
        tl.store(dst + cache_kv_stride + c, val.to(cache_ptr.dtype.element_ty), mask=cm)


def rope_and_write_kv_triton(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    head_dim: int,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` and ``k`` in place and store ``k``/``v`` at their slots: one Triton launch,
    capturable in a CUDA graph (the grid depends only on ``q.shape[0]``).

    Args:
        positions: int64 ``[T]``, each token's position (an index into ``cos_sin_cache``; a
            position past it reads out of bounds, as flashinfer's kernel would).
        q: ``[T, num_heads * head_dim]``; k, v: ``[T, num_kv_heads * head_dim]``; CUDA tensors of
            one dtype, contiguous inside a row (row-strided views of a merged QKV output are
            fine).
        head_dim: size of one head.
        cos_sin_cache: float32 ``[max_position, rotary_dim]`` (cosines, then sines), ``rotary_dim``
            even and at most ``head_dim``.
        kv_cache: ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``, its
            ``[num_kv_heads, head_dim]`` rows contiguous; written in place.
        slot_mapping: int64 ``[>= T]``, ``block * block_size + offset`` of each token, negative
            for a padding row (its q/k are still rotated; nothing is stored).
        pdl: launch as a programmatic dependent launch (only where
            :func:`custom_ops.skinny_gemm.pdl_supported`), so that the kernels around it in a
            decode step's chain of PDL launches do not pay a launch gap at its boundaries.

    Returns:
        ``(q, k)``, the same tensors, rotated.

    Raises:
        ValueError: shapes that do not fit, a non-float32 cos/sin cache, a non-int64 slot
            mapping or positions, tensors on different devices, rows that are not contiguous.
        RuntimeError: Triton is not installed.
    """
    if triton is None:
        raise RuntimeError("rope_and_write_kv_triton needs Triton (a CUDA build of torch)")
    num_tokens, num_heads, num_kv_heads = _check_args(
        positions, q, k, v, head_dim, cos_sin_cache, kv_cache, slot_mapping
    )
    if cos_sin_cache.dtype != torch.float32:
        raise ValueError(f"cos_sin_cache must be float32, got {cos_sin_cache.dtype}")
    for name, x in (("positions", positions), ("slot_mapping", slot_mapping)):
        if x.dtype != torch.int64:
            raise ValueError(f"{name} must be int64, got {x.dtype}")
    tensors = (("positions", positions), ("q", q), ("k", k), ("v", v))
    tensors += (("cos_sin_cache", cos_sin_cache), ("slot_mapping", slot_mapping))
    for name, x in tensors:
        if x.device != kv_cache.device:
            raise ValueError(f"{name} is on {x.device}, the cache on {kv_cache.device}")
    for name, x in (("q", q), ("k", k), ("v", v), ("cos_sin_cache", cos_sin_cache)):
        if x.stride(1) != 1:
            raise ValueError(f"{name}'s rows must be contiguous, got strides {x.stride()}")
    if kv_cache.stride(4) != 1 or kv_cache.stride(3) != head_dim:
        raise ValueError("kv_cache's [num_kv_heads, head_dim] rows must be contiguous")
    if num_tokens == 0:
        return q, k
    half = cos_sin_cache.shape[1] // 2
    rest = head_dim - 2 * half
    p2 = triton.next_power_of_2
    _rope_write_kv_kernel[(num_tokens,)](
        positions,
        q,
        k,
        v,
        cos_sin_cache,
        kv_cache,
        slot_mapping,
        q.stride(0),
        k.stride(0),
        v.stride(0),
        cos_sin_cache.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.shape[2],
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HALF=half,
        HALF_P2=p2(half),
        HEADS_P2=p2(num_heads),
        KV_HEADS_P2=p2(num_kv_heads),
        PASS=rest,
        PASS_P2=p2(max(rest, 1)),
        ROW_P2=p2(num_kv_heads * head_dim),
        PDL=pdl,
        num_warps=4,
        **({"launch_pdl": True} if pdl else {}),  # Tritons before 3.4 reject the option
    )
    return q, k


def rope_and_write_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    head_dim: int,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rope_and_write_kv_triton` on CUDA (with Triton), else
    :func:`rope_and_write_kv_torch`; arguments, result and errors as those functions."""
    if kv_cache.is_cuda and triton is not None:
        return rope_and_write_kv_triton(
            positions, q, k, v, head_dim, cos_sin_cache, kv_cache, slot_mapping
        )
    return rope_and_write_kv_torch(
        positions, q, k, v, head_dim, cos_sin_cache, kv_cache, slot_mapping
    )
