"""Llama-family decoder, shared by every dense architecture we serve.

One implementation with flags (:class:`DecoderFlags`); an architecture is a thin subclass that
reads its flags from the Hugging Face config. This file's own architectures: Llama (and SmolLM2)
and Mistral without a sliding window. Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm) are in
their own files.

The forward pass is written as pieces so that piecewise CUDA graphs can split it at attention
without ``torch.compile``: ``embed``, then per layer ``pre_attention`` -> ``attn`` ->
``post_attention``, then ``final_norm``. :meth:`DecoderForCausalLM.forward` is exactly that.

Under tensor parallelism with the fused all-reduce (``TPGroup.allreduce_fusion``), ``o_proj`` and
the MLP's ``down_proj`` return their rank's partial sums, and the norm that follows each of them
(post-attention, the next layer's input norm, the final norm) all-reduces, adds the residual and
normalises in one kernel; the hidden states between ``post_attention`` and the next
``pre_attention`` are then partial sums.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fastdeploy.distributed.parallel_state import TPGroup
from fastdeploy.model_executor.forward_meta import ForwardMeta
from fastdeploy.model_executor.layers.activation import SiluAndMul
from fastdeploy.model_executor.layers.allreduce_fusion import AllReduceFusion
from fastdeploy.model_executor.layers.attention.attention import Attention
from fastdeploy.model_executor.layers.embeddings import LMHead, VocabEmbedding
from fastdeploy.model_executor.layers.linear import (
    Linear,
    MergedLinear,
    QKVLinear,
    gated_silu_linear,
)
from fastdeploy.model_executor.layers.normalization import RMSNorm
from fastdeploy.model_executor.layers.parallel_linear import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from fastdeploy.model_executor.layers.rotary_embedding import (
    RotaryEmbedding,
    rope_parameters_from_config,
)
from fastdeploy.model_executor.models.hf_weights import (
    dense_weight_names,
    export_hf_weights,
    load_hf_weights,
    locate_dense_weight,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecoderFlags:
    """What differs between the dense decoders we serve."""

    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)


def _head_dim(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _warn_sliding_window(cfg: Any) -> None:
    window = getattr(cfg, "sliding_window", None)
    if not getattr(cfg, "use_sliding_window", True):
        window = None
    if window and window < cfg.max_position_embeddings:
        logger.warning(
            "sliding_window=%s is not supported: attention is over the full context, so outputs "
            "of sequences longer than %s tokens differ from the reference model",
            window,
            window,
        )


class DecoderMLP(nn.Module):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))``, ``[T, hidden]`` -> ``[T, hidden]``.

    With a tensor-parallel group ``tp`` the intermediate size is split across ranks
    (column-parallel gate/up, row-parallel down with one all-reduce). ``reduce=False`` leaves that
    all-reduce to the next norm (the fused all-reduce): the output is this rank's partial sum.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        dtype: torch.dtype,
        tp: TPGroup | None = None,
        reduce: bool = True,
    ):
        super().__init__()
        self.reduce = reduce
        if tp is not None and tp.world_size > 1:
            self.gate_up_proj = MergedColumnParallelLinear(
                hidden_size, [intermediate_size] * 2, [0, 1], bias=bias, dtype=dtype, tp=tp
            )
            self.down_proj = RowParallelLinear(
                intermediate_size, hidden_size, bias=bias, dtype=dtype, tp=tp, reduce=reduce
            )
        else:
            self.reduce = True  # one rank: the output is the whole sum
            self.gate_up_proj = MergedLinear(
                hidden_size, [intermediate_size] * 2, [0, 1], bias=bias, dtype=dtype
            )
            self.down_proj = Linear(intermediate_size, hidden_size, bias=bias, dtype=dtype)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Each rank's gate/up weight is [its gate rows; its up rows], so the activation can run
        # in the projection's kernel with or without tensor parallelism.
        proj = self.gate_up_proj
        return self.down_proj(gated_silu_linear(x, proj.weight, proj.bias, self.act_fn))


class DecoderLayer(nn.Module):
    """One pre-norm decoder layer, split at attention.

    ``hidden_states`` and ``residual`` are ``[T, hidden_size]`` in the model dtype; ``residual`` is
    None only entering the first layer. ``mlp`` replaces the dense SwiGLU MLP (a mixture of
    experts, say): any module ``[T, hidden]`` -> ``[T, hidden]``. With a tensor-parallel group
    ``tp`` the layer holds ``num_heads / N`` query and ``num_kv_heads / N`` KV heads (the
    numbers must divide) and its output projection all-reduces; with ``tp.allreduce_fusion`` that
    all-reduce moves into the norms (module docstring), and ``mlp`` must then return partial sums
    (a :class:`DecoderMLP` with ``reduce=False``).

    Raises:
        ValueError: the fused all-reduce with an MLP that reduces its own output.
    """

    def __init__(
        self,
        cfg: Any,
        layer_idx: int,
        flags: DecoderFlags,
        rotary_emb: nn.Module,
        dtype: torch.dtype,
        mlp: nn.Module | None = None,
        tp: TPGroup | None = None,
    ):
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        self.head_dim = _head_dim(cfg)
        self.input_layernorm = RMSNorm(hidden, eps, dtype)
        sharded = tp is not None and tp.world_size > 1
        self.allreduce_fusion: AllReduceFusion | None = tp.allreduce_fusion if sharded else None
        fused = self.allreduce_fusion is not None
        if sharded:
            self.qkv_proj = QKVParallelLinear(
                hidden, self.head_dim, heads, kv_heads, flags.qkv_bias, dtype, tp=tp
            )
        else:
            self.qkv_proj = QKVLinear(hidden, self.head_dim, heads, kv_heads, flags.qkv_bias, dtype)
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_norm = RMSNorm(self.head_dim, eps, dtype) if flags.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps, dtype) if flags.qk_norm else None
        self.rotary_emb = rotary_emb  # shared by all layers
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, layer_idx)
        if sharded:
            self.o_proj = RowParallelLinear(
                heads * self.head_dim,
                hidden,
                bias=flags.o_proj_bias,
                dtype=dtype,
                tp=tp,
                reduce=not fused,
            )
        else:
            self.o_proj = Linear(heads * self.head_dim, hidden, bias=flags.o_proj_bias, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype)
        if mlp is None:
            mlp = DecoderMLP(hidden, cfg.intermediate_size, flags.mlp_bias, dtype, tp, not fused)
        if fused and getattr(mlp, "reduce", True):
            raise ValueError(
                f"layer {layer_idx}: the fused all-reduce needs an MLP that returns partial sums "
                f"(DecoderMLP with reduce=False); got {type(mlp).__name__}"
            )
        self.mlp = mlp

    def _add_norm(
        self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``; with the fused all-reduce ``x`` is this rank's
        partial sum and is all-reduced first, in the same kernel."""
        if self.allreduce_fusion is None:
            return norm(x, residual)
        return self.allreduce_fusion(x, residual, norm)

    def _head_norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return norm(x.reshape(x.shape[0], -1, self.head_dim)).reshape(x.shape)

    def pre_attention(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        qkv_out: torch.Tensor | None = None,
        kv_store: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Input norm (with the residual add), q/k/v projection, q/k norm, RoPE.

        Args:
            positions: int64 ``[T]``.
            qkv_out: optional ``[T, (H + 2 * KV) * head_dim]`` buffer the merged projection
                writes into; ``q``, ``k`` and ``v`` are then views of it (``q`` and ``k`` new
                tensors where a q/k norm applies).
            kv_store: optional ``(kv_cache, slot_mapping)`` of this layer: the rotated ``k``
                and ``v`` are also stored there, in the RoPE kernel on CUDA
                (``rotary_emb.forward_and_store``), so the attention must not write them again.

        Returns:
            ``q [T, H * head_dim]``, ``k`` and ``v [T, KV * head_dim]``, ``residual [T, hidden]``.
        """
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self._add_norm(self.input_layernorm, hidden_states, residual)
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states, out=qkv_out))
        if self.q_norm is not None:
            q = self._head_norm(self.q_norm, q)
            k = self._head_norm(self.k_norm, k)
        if kv_store is None:
            q, k = self.rotary_emb(positions, q, k)
        else:
            q, k = self.rotary_emb.forward_and_store(positions, q, k, v, *kv_store)
        return q, k, v, residual

    def post_attention(
        self, attn_output: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Output projection, residual add, post-attention norm, MLP.

        Args:
            attn_output: ``[T, H * head_dim]``.

        Returns:
            ``(hidden_states, residual)``, both ``[T, hidden]``; the residual add of the MLP
            output is left to the next layer's input norm (or :meth:`final_norm`).
        """
        hidden_states = self.o_proj(attn_output)
        hidden_states, residual = self._add_norm(
            self.post_attention_layernorm, hidden_states, residual
        )
        return self.mlp(hidden_states), residual


class DecoderForCausalLM(nn.Module):
    """A dense decoder-only language model (the shared implementation).

    Args:
        hf_config: the Hugging Face config (``LlamaConfig``, ``Qwen3Config``, ...).
        dtype: parameter and activation dtype.
        tp: the tensor-parallel group (None or one rank: unsharded). Each rank holds
            ``1/N`` of the heads, the MLP and the vocabulary; :meth:`load_weights` takes the
            full checkpoint tensors and keeps this rank's part. ``tp.allreduce_fusion`` moves
            the row-parallel all-reduces into the norms (module docstring).

    Raises:
        ValueError: ``hidden_act`` other than ``silu``, an unsupported RoPE type, or a head
            count / intermediate size that does not divide by the rank count (names both).
    """

    #: Whether ``tp`` (a tensor-parallel group of more than one rank) is implemented: every
    #: layer of the dense decoders splits; the experts of the MoE decoders do not yet.
    supports_tensor_parallel: bool = True

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        """The architecture's flags; subclasses override."""
        return DecoderFlags()

    def make_rotary_embedding(self, hf_config: Any, dtype: torch.dtype) -> nn.Module:
        """The RoPE module shared by all layers; subclasses override (partial or interleaved)."""
        return RotaryEmbedding(
            _head_dim(hf_config),
            hf_config.max_position_embeddings,
            rope_parameters_from_config(hf_config),
            dtype,
        )

    def make_mlp(self, hf_config: Any, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        """The feed-forward block of layer ``layer_idx``; subclasses override (experts)."""
        return DecoderMLP(
            hf_config.hidden_size,
            hf_config.intermediate_size,
            self.flags.mlp_bias,
            dtype,
            self.tp,
            reduce=self.allreduce_fusion is None,
        )

    def __init__(
        self, hf_config: Any, dtype: torch.dtype = torch.float32, tp: TPGroup | None = None
    ):
        super().__init__()
        self.tp = tp if tp is not None and tp.world_size > 1 else None
        self.allreduce_fusion = None if self.tp is None else self.tp.allreduce_fusion
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported; supported: 'silu'")
        _warn_sliding_window(hf_config)
        self.config = hf_config
        self.flags = self.decoder_flags(hf_config)
        self.hidden_size = hf_config.hidden_size
        self.vocab_size = hf_config.vocab_size
        if self.tp is not None:
            self.embed_tokens = VocabParallelEmbedding(
                self.vocab_size, self.hidden_size, dtype, tp=self.tp
            )
        else:
            self.embed_tokens = VocabEmbedding(self.vocab_size, self.hidden_size, dtype)
        self.rotary_emb = self.make_rotary_embedding(hf_config, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(
                hf_config,
                i,
                self.flags,
                self.rotary_emb,
                dtype,
                self.make_mlp(hf_config, i, dtype),
                self.tp,
            )
            for i in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(self.hidden_size, hf_config.rms_norm_eps, dtype)
        if self.tp is not None:
            self.lm_head = ParallelLMHead(self.vocab_size, self.hidden_size, dtype, tp=self.tp)
        else:
            self.lm_head = LMHead(self.vocab_size, self.hidden_size, dtype)
        if getattr(hf_config, "tie_word_embeddings", False):
            self.lm_head.tie_to(self.embed_tokens)

    @property
    def dtype(self) -> torch.dtype:
        """The parameter dtype (follows ``.to(dtype)``)."""
        return self.embed_tokens.weight.dtype

    # ---- forward, in pieces -------------------------------------------------------------------

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """int64 ``[T]`` -> ``[T, hidden_size]``."""
        return self.embed_tokens(input_ids)

    def final_norm(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The last residual add and the final norm: ``[T, hidden_size]`` each -> the same
        (``hidden_states`` a partial sum under the fused all-reduce, which reduces it here)."""
        if self.allreduce_fusion is None:
            return self.norm(hidden_states, residual)[0]
        return self.allreduce_fusion(hidden_states, residual, self.norm)[0]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_meta: ForwardMeta
    ) -> torch.Tensor:
        """Hidden states of every token in the step.

        Args:
            input_ids, positions: int64 ``[T]`` (``T`` may include padding rows).
            forward_meta: the step's attention backend, metadata and KV caches.

        Returns:
            ``[T, hidden_size]`` in the model dtype.
        """
        hidden_states = self.embed(input_ids)
        residual = None
        for layer in self.layers:
            store = forward_meta.kv_store(layer.attn.layer_idx)
            q, k, v, residual = layer.pre_attention(
                positions, hidden_states, residual, kv_store=store
            )
            attn_output = layer.attn(q, k, v, forward_meta, write_kv=store is None)
            hidden_states, residual = layer.post_attention(attn_output, residual)
        return self.final_norm(hidden_states, residual)

    def compute_logits(
        self, hidden_states: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``[N, hidden_size]`` (model dtype) -> float32 ``[N, vocab_size]``, never rounded to
        the model dtype (:class:`~fastdeploy.model_executor.layers.embeddings.LMHead`). ``out``
        (float32 ``[N, vocab_size]``) receives the logits: a full decode graph writes its rows
        of one buffer that every decode bucket shares."""
        if out is None:
            return self.lm_head(hidden_states)
        # the tensor-parallel head (all-gathered logits) takes no out: never given one
        return self.lm_head(hidden_states, out=out)

    # ------------------------------------------------------------ Hugging Face weights
    def locate_weight(self, hf_name: str) -> tuple[nn.Module, str, Hashable | None]:
        """Where the checkpoint tensor ``hf_name`` goes: ``(module, parameter name, shard)``
        (:func:`~fastdeploy.model_executor.models.hf_weights.locate_dense_weight`).

        Raises:
            ValueError: a name this model has no parameter for.
        """
        return locate_dense_weight(self, hf_name)

    def hf_weight_names(self) -> list[str]:
        """The Hugging Face names a checkpoint of this model must provide (tied head excluded)."""
        return dense_weight_names(self)

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> set[str]:
        """Copy checkpoint tensors given under Hugging Face names into the model
        (:func:`~fastdeploy.model_executor.models.hf_weights.load_hf_weights`); returns the
        names loaded.

        Raises:
            ValueError: an unknown name, a shape mismatch, or (``strict``) a missing weight.
        """
        return load_hf_weights(self, weights, strict)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """All weights under Hugging Face names, views of the model's
        (:func:`~fastdeploy.model_executor.models.hf_weights.export_hf_weights`)."""
        return export_hf_weights(self)


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama 1-3 and SmolLM2: optional ``attention_bias`` (q/k/v/o) and ``mlp_bias``."""

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderFlags(
            qkv_bias=bias, o_proj_bias=bias, mlp_bias=bool(getattr(hf_config, "mlp_bias", False))
        )


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: a Llama without biases; a sliding window is not supported (a warning says so)."""
