"""Rotary position embedding (RoPE; Su et al., 2021, "RoFormer").

:class:`RotaryEmbedding` is the neox / Hugging Face Llama style: the (rotated part of the) head is
split in two halves that rotate together (``rotate_half``). With ``rotary_dim < head_dim`` only the
first ``rotary_dim`` features of each head rotate and the rest pass through (GLM-4's partial
rotary, ``partial_rotary_factor``). :class:`InterleavedRotaryEmbedding` rotates adjacent pairs
``(2i, 2i + 1)`` in float32 (the GPT-J layout ERNIE 4.5 uses, as in ``transformers``'
``modeling_ernie4_5.apply_rotary_pos_emb``).
cos/sin are precomputed for every position up to ``max_position`` once, in float32, then cast to
the model dtype (kept in float32 by the interleaved variant): the same numbers Hugging Face
computes per step, so outputs match it exactly.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from custom_ops.kv_cache_ops import write_kv_cache
from fastdeploy.model_executor.layers.fused_ops import use_flashinfer

ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters_from_config(hf_config: Any) -> dict[str, Any]:
    """The RoPE parameters of a Hugging Face config, normalised to one flat dict.

    transformers >= 5 keeps them in ``config.rope_parameters`` (with ``rope_theta`` inside);
    older versions use ``config.rope_theta`` plus an optional ``config.rope_scaling`` dict whose
    type key is ``rope_type`` or ``type``. Both are read here.

    Returns:
        dict with at least ``rope_type`` and ``rope_theta`` (float), plus the type's own keys.
    """
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    params = dict(params or {})
    rope_type = params.get("rope_type", params.get("type")) or "default"
    params["rope_type"] = rope_type
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    params["rope_theta"] = float(theta if theta is not None else 10000.0)
    if rope_type == "llama3":
        params.setdefault(
            "original_max_position_embeddings",
            getattr(hf_config, "original_max_position_embeddings", None)
            or hf_config.max_position_embeddings,
        )
    return params


def compute_inv_freq(rotary_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """Inverse frequencies ``[rotary_dim // 2]`` float32 for ``params`` (see above).

    Types: ``default`` (``theta ** (-2i / d)``), ``linear`` (position interpolation, Chen et al.
    2023: frequencies divided by ``factor``), ``llama3`` (Meta's Llama 3.1 reference
    ``apply_scaling``: low frequencies divided by ``factor``, high ones kept, a smooth blend
    between ``low_freq_factor`` and ``high_freq_factor``).

    Raises:
        ValueError: an unsupported ``rope_type`` (the message lists the supported ones).
    """
    rope_type = params["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type={rope_type!r} is not supported; supported: {ROPE_TYPES}")
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (params["rope_theta"] ** exponent)
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        factor = params["factor"]
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dimension (the neox rotation)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _RotateThenStore(nn.Module):
    """What both RoPE layouts share: :meth:`forward_and_store` as RoPE, then the KV write."""

    def forward_and_store(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward(positions, q, k)``, then the rotated ``k`` and ``v`` stored at
        ``slot_mapping`` (int64 ``[>= T]``, negative for a padding row) of ``kv_cache``
        (``[num_blocks, 2, block_size, KV, head_dim]``) with
        :func:`custom_ops.kv_cache_ops.write_kv_cache`. Returns ``(q, k)`` rotated."""
        q, k = self.forward(positions, q, k)
        write_kv_cache(k, v, kv_cache, slot_mapping)
        return q, k


class RotaryEmbedding(_RotateThenStore):
    """Applies RoPE to queries and keys by position.

    Args:
        head_dim: size of one head.
        max_position: positions ``0 .. max_position - 1`` are cached; larger ones are out of range
            (an index error on CPU, a device assert on GPU).
        rope_params: from :func:`rope_parameters_from_config`.
        dtype: dtype of the cos/sin cache (the model dtype).
        rotary_dim: features of each head that rotate (the first ones); None: all of them.

    Raises:
        ValueError: ``rotary_dim`` odd or not in ``(0, head_dim]``.
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        rope_params: dict[str, Any],
        dtype: torch.dtype = torch.float32,
        rotary_dim: int | None = None,
    ):
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
            raise ValueError(
                f"rotary_dim={rotary_dim} must be even and in (0, head_dim={head_dim}]"
            )
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        self.rope_type = rope_params["rope_type"]
        inv_freq = compute_inv_freq(rotary_dim, rope_params)
        t = torch.arange(max_position, dtype=torch.int64).float()
        freqs = t[:, None] * inv_freq.to(t.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        # Not persistent: rebuilt from the config, never read from checkpoints.
        self.register_buffer("cos_cache", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin_cache", emb.sin().to(dtype), persistent=False)
        # flashinfer's layout: float32 [max_position, rotary_dim], cos of the rotary_dim / 2
        # frequencies, then their sin.
        half = rotary_dim // 2
        cos_sin = torch.cat((emb[:, :half].cos(), emb[:, :half].sin()), dim=-1)
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q [T, H * head_dim]`` and ``k [T, KV * head_dim]`` by ``positions [T]`` int64.

        On CUDA with the fused ops on (:mod:`~fastdeploy.model_executor.layers.fused_ops`) one
        flashinfer kernel (``apply_rope_with_cos_sin_cache_inplace``, float32 cos/sin) rotates
        ``q`` and ``k`` **in place** (they may be strided views of the merged q/k/v output) and
        returns them; elsewhere :meth:`forward_native`.

        Returns:
            ``(q, k)`` of the same shapes and dtypes, rotated.
        """
        cache = self.cos_sin_cache
        if (
            use_flashinfer(q)
            and cache.dtype == torch.float32
            and q.stride(-1) == 1
            and k.stride(-1) == 1
        ):
            import flashinfer.rope

            flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(
                positions, q, k, self.head_dim, cache, is_neox=True
            )
            return q, k
        return self.forward_native(positions, q, k)

    def forward_and_store(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward`, then the rotated ``k`` and ``v`` stored at their slots (arguments
        as the base's). On CUDA with the fused ops on this is one Triton kernel
        (:func:`custom_ops.rope_kv_ops.rope_and_write_kv_triton`: ``q``/``k`` rotated in place,
        float32 cos/sin as flashinfer's RoPE) instead of the RoPE kernel plus the KV write;
        elsewhere the base's two steps."""
        if (
            use_flashinfer(q)
            and self.cos_sin_cache.dtype == torch.float32
            and q.stride(-1) == 1
            and k.stride(-1) == 1
            and v.stride(-1) == 1
        ):
            from custom_ops.rope_kv_ops import rope_and_write_kv_triton
            from fastdeploy.model_executor.layers.linear import skinny_pdl

            return rope_and_write_kv_triton(
                positions, q, k, v, self.head_dim, self.cos_sin_cache, kv_cache, slot_mapping,
                pdl=skinny_pdl(q.device),
            )  # fmt: skip
        return super().forward_and_store(positions, q, k, v, kv_cache, slot_mapping)

    def forward_native(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch reference of :meth:`forward` (cos/sin in the model dtype, as Hugging Face
        computes them; new tensors, never in place)."""
        cos = self.cos_cache[positions].unsqueeze(1)  # [T, 1, rotary_dim]
        sin = self.sin_cache[positions].unsqueeze(1)
        qh = q.reshape(q.shape[0], -1, self.head_dim)
        kh = k.reshape(k.shape[0], -1, self.head_dim)
        if self.rotary_dim == self.head_dim:
            q_out = qh * cos + rotate_half(qh) * sin
            k_out = kh * cos + rotate_half(kh) * sin
        else:
            q_out = self._rotate_part(qh, cos, sin)
            k_out = self._rotate_part(kh, cos, sin)
        return q_out.reshape(q.shape), k_out.reshape(k.shape)

    def _rotate_part(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, "
            f"max_position={self.max_position}, type={self.rope_type}"
        )


def rotate_interleaved(x: torch.Tensor) -> torch.Tensor:
    """``[x0, x1, x2, x3, ...] -> [-x1, x0, -x3, x2, ...]`` over the last dimension (the GPT-J
    rotation of adjacent pairs)."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


class InterleavedRotaryEmbedding(_RotateThenStore):
    """RoPE over adjacent pairs ``(2i, 2i + 1)`` of each head, computed in float32 and cast back
    (ERNIE 4.5; ``transformers``' ``Ernie4_5RotaryEmbedding`` keeps cos/sin in float32 and
    rotates ``q.float()``).

    Args:
        head_dim: size of one head (rotated in full).
        max_position: positions ``0 .. max_position - 1`` are cached.
        rope_params: from :func:`rope_parameters_from_config`.
    """

    def __init__(self, head_dim: int, max_position: int, rope_params: dict[str, Any]):
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.rope_type = rope_params["rope_type"]
        inv_freq = compute_inv_freq(head_dim, rope_params)
        t = torch.arange(max_position, dtype=torch.int64).float()
        freqs = t[:, None] * inv_freq.to(t.device)[None, :]
        # pair i of the head uses frequency i for both of its features
        emb = freqs.repeat_interleave(2, dim=-1)
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q [T, H * head_dim]`` and ``k [T, KV * head_dim]`` by ``positions [T]`` int64.

        Returns:
            new ``(q, k)`` tensors of the same shapes and dtypes.
        """
        cos = self.cos_cache[positions].unsqueeze(1)  # [T, 1, head_dim] float32
        sin = self.sin_cache[positions].unsqueeze(1)

        def rotate(x: torch.Tensor) -> torch.Tensor:
            xh = x.reshape(x.shape[0], -1, self.head_dim)
            out = xh.float() * cos + rotate_interleaved(xh).float() * sin
            return out.to(x.dtype).reshape(x.shape)

        return rotate(q), rotate(k)

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, max_position={self.max_position}, "
            f"type={self.rope_type}, interleaved"
        )
