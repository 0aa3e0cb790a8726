"""Writing a step's keys and values into the paged KV cache through a flat slot mapping.

The cache of one layer is ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` (flashinfer's
"NHD" paged layout; index 0 of dim 1 is K, 1 is V). Token ``t`` goes to slot
``s = slot_mapping[t]``, i.e. row ``s % block_size`` of block ``s // block_size``; ``s < 0`` marks
a padding row, which writes nothing.

Why a Triton kernel and not a library call: flashinfer 0.5.3's ``append_paged_kv_cache`` addresses
tokens by ``(batch_indices, positions)`` plus the paged indptr/indices, which needs an extra kernel
per step to derive them and cannot express padding rows (every row must belong to a request). The
runner already has a flat slot mapping with -1 for padding, as vLLM's ``reshape_and_cache_flash``
uses; one program per (token, chunk of ``num_kv_heads * head_dim``) copies K and V, and a padding
row returns before touching memory. The kernel reads nothing on the host and launches a grid that
depends only on ``k.shape[0]``, so it can be captured in a CUDA graph.
"""

import math

import torch

try:  # Triton ships with CUDA builds of torch; CPU CI has none and uses the reference.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installed torch build
    triton = None
    tl = None

__all__ = ["write_kv_cache", "write_kv_cache_torch", "write_kv_cache_triton"]

# Elements of one token's ``num_kv_heads * head_dim`` row that one Triton program copies.
_MAX_CHUNK = 1024


def _check_args(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> tuple[int, int, int]:
    """Validate shapes; returns ``(num_tokens, num_kv_heads, head_dim)``."""
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(
            f"kv_cache must be [num_blocks, 2, block_size, num_kv_heads, head_dim], "
            f"got {tuple(kv_cache.shape)}"
        )
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    num_tokens = k.shape[0]
    for name, x in (("k", k), ("v", v)):
        if x.shape[0] != num_tokens or math.prod(x.shape[1:]) != num_kv_heads * head_dim:
            raise ValueError(
                f"{name} must be [T, {num_kv_heads * head_dim}] or [T, {num_kv_heads}, {head_dim}] "
                f"with T={num_tokens}, got {tuple(x.shape)}"
            )
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] < num_tokens:
        raise ValueError(
            f"slot_mapping must be 1-D with at least {num_tokens} entries, "
            f"got {tuple(slot_mapping.shape)}"
        )
    return num_tokens, num_kv_heads, head_dim


def write_kv_cache_torch(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Reference KV write in plain PyTorch, in place (used on CPU and as the tests' reference).

    Selecting the valid rows is data-dependent (it synchronises with the device), so this cannot
    be captured in a CUDA graph; :func:`write_kv_cache_triton` can.

    Args:
        k, v: ``[T, num_kv_heads * head_dim]`` or ``[T, num_kv_heads, head_dim]``, the cache dtype.
        kv_cache: ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``, modified in place.
        slot_mapping: int64 ``[>= T]``; entry ``t`` is token ``t``'s slot
            (``block * block_size + offset``), negative for padding rows (nothing written). Only
            the first ``T`` entries are read.

    Raises:
        ValueError: shapes that do not fit together.
    """
    num_tokens, num_kv_heads, head_dim = _check_args(k, v, kv_cache, slot_mapping)
    block_size = kv_cache.shape[2]
    slots = slot_mapping[:num_tokens].to(device=kv_cache.device, dtype=torch.int64)
    valid = slots >= 0
    slots = slots[valid]
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots % block_size
    kv_cache[blocks, 0, offsets] = k.reshape(num_tokens, num_kv_heads, head_dim)[valid].to(
        kv_cache.dtype
    )
    kv_cache[blocks, 1, offsets] = v.reshape(num_tokens, num_kv_heads, head_dim)[valid].to(
        kv_cache.dtype
    )


if triton is not None:

    @triton.jit
    def _write_kv_cache_kernel(
        k_ptr,  # [T, row_len] rows, k_row_stride elements apart, contiguous inside a row
        v_ptr,  # same for V
        cache_ptr,  # [num_blocks, 2, block_size, row_len], inner row contiguous
        slot_ptr,  # int64 [>= T]
        k_row_stride,
        v_row_stride,
        cache_block_stride,
        cache_kv_stride,
        cache_slot_stride,
        block_size,
        ROW_LEN: tl.constexpr,  # num_kv_heads * head_dim
        CHUNK: tl.constexpr,  # power of two
    ):
        # int64 offsets: a large cache overflows int32 (block * cache_block_stride).
        token = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot < 0:  # padding row: write nothing
            return
        block = slot // block_size
        offset = slot % block_size
        cols = chunk * CHUNK + tl.arange(0, CHUNK)
        mask = cols < ROW_LEN
        k_row = tl.load(k_ptr + token * k_row_stride + cols, mask=mask)
        v_row = tl.load(v_ptr + token * v_row_stride + cols, mask=mask)
        dst = cache_ptr + block * cache_block_stride + offset * cache_slot_stride + cols
        tl.store(dst, k_row.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + cache_kv_stride, v_row.to(cache_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor, num_tokens: int, row_len: int) -> torch.Tensor:
    """``x`` as ``[T, row_len]`` with each row contiguous (a view when possible, e.g. a split of a
    fused QKV projection; a copy otherwise)."""
    x2 = x.reshape(num_tokens, row_len) if x.dim() != 2 else x
    if row_len > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    return x2


def write_kv_cache_triton(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """KV write with the Triton kernel (CUDA tensors), in place; capturable in a CUDA graph.

    Arguments as :func:`write_kv_cache_torch`; ``slot_mapping`` must be int64 on the cache's device
    and the cache's ``[num_kv_heads, head_dim]`` rows contiguous. One program per token and chunk of
    at most 1024 elements of its ``num_kv_heads * head_dim`` row; programs whose slot is negative
    return without a store.

    Raises:
        ValueError: shapes that do not fit, a non-int64 slot mapping, a non-contiguous cache row.
        RuntimeError: Triton is not installed.
    """
    if triton is None:
        raise RuntimeError("write_kv_cache_triton needs Triton (a CUDA build of torch)")
    num_tokens, num_kv_heads, head_dim = _check_args(k, v, kv_cache, slot_mapping)
    if slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64, got {slot_mapping.dtype}")
    for name, x in (("k", k), ("v", v), ("slot_mapping", slot_mapping)):
        if x.device != kv_cache.device:
            raise ValueError(f"{name} is on {x.device}, the cache on {kv_cache.device}")
    if kv_cache.stride(4) != 1 or kv_cache.stride(3) != head_dim:
        raise ValueError("kv_cache's [num_kv_heads, head_dim] rows must be contiguous")
    if num_tokens == 0:
        return
    row_len = num_kv_heads * head_dim
    k2 = _rows(k, num_tokens, row_len)
    v2 = _rows(v, num_tokens, row_len)
    chunk = min(triton.next_power_of_2(row_len), _MAX_CHUNK)
    grid = (num_tokens, triton.cdiv(row_len, chunk))
    _write_kv_cache_kernel[grid](
        k2,
        v2,
        kv_cache,
        slot_mapping,
        k2.stride(0),
        v2.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.shape[2],
        ROW_LEN=row_len,
        CHUNK=chunk,
        num_warps=4,
    )


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store each token's K and V at its slot, in place; padding rows (slot < 0) write nothing.

    On CUDA (with Triton) this is :func:`write_kv_cache_triton`, which a CUDA graph can capture;
    elsewhere :func:`write_kv_cache_torch`. Arguments and errors as those functions.
    """
    if kv_cache.is_cuda and triton is not None:
        write_kv_cache_triton(k, v, kv_cache, slot_mapping)
    else:
        write_kv_cache_torch(k, v, kv_cache, slot_mapping)
