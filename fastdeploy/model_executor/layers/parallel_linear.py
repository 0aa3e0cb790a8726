"""Tensor-parallel linears and embeddings (Megatron-LM's column/row split, as vLLM lays it out).

Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism": a column-parallel linear splits the output rows across ranks (no communication), the
following row-parallel linear splits its input columns and sums the partial products with one
all-reduce. Attention splits heads (q heads and KV heads each divide by the rank count, or the
layer refuses with the numbers); the MLP splits the intermediate size; the vocabulary is split
into contiguous ranges for the embedding (masked lookup + all-reduce) and the LM head (local logits,
then an all-gather).

Every layer loads the *full* checkpoint tensor and keeps its own rank's slice, so the loaders shard
safetensors and GGUF weights at load time without knowing the split. ``export_weight`` returns the
local slice. With ``tp=None`` (or one rank) each layer is its unsharded base class.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fastdeploy.distributed.parallel_state import TPGroup, all_gather_last_dim, all_reduce
from fastdeploy.model_executor.layers.embeddings import LMHead, VocabEmbedding
from fastdeploy.model_executor.layers.linear import (
    Linear,
    MergedLinear,
    QKVLinear,
    copy_weight,
    linear,
)


def tp_rank_world(tp: TPGroup | None) -> tuple[int, int]:
    """``(rank, world_size)``; ``(0, 1)`` without a group."""
    return (0, 1) if tp is None else (tp.rank, tp.world_size)


def divide(total: int, world: int, what: str) -> int:
    """``total // world``.

    Raises:
        ValueError: ``total`` does not divide by ``world`` (names both and ``what``).
    """
    if total % world:
        raise ValueError(
            f"{what}={total} does not divide by tensor_parallel_size={world}; allowed: a "
            f"tensor_parallel_size that divides {total}"
        )
    return total // world


def rank_slice(loaded: torch.Tensor, dim: int, rank: int, world: int, name: str) -> torch.Tensor:
    """This rank's contiguous ``1/world`` of ``loaded`` along ``dim``.

    Raises:
        ValueError: that dimension does not divide by ``world``.
    """
    size = divide(loaded.shape[dim], world, f"{name} dim {dim}")
    return loaded.narrow(dim, rank * size, size)


def shard_rows(
    layer: torch.nn.Module,
    param_name: str,
    loaded: torch.Tensor,
    shard_id: Hashable | None,
    rank: int,
    world: int,
) -> torch.Tensor:
    """This rank's contiguous rows of one full checkpoint shard (q, k, v; gate, up) of a merged
    column-parallel ``layer``; the whole tensor without TP.

    Raises:
        KeyError: ``shard_id`` None under TP (a merged checkpoint tensor interleaves the shards,
            so it cannot be sliced by rank).
    """
    if shard_id is None and world > 1:
        raise KeyError(f"{type(layer).__name__} under TP loads one shard at a time")
    if shard_id is None:
        return loaded
    return rank_slice(loaded, 0, rank, world, f"{param_name}[{shard_id}]")


class MergedColumnParallelLinear(MergedLinear):
    """Merged projections (gate/up) with each shard's output rows split across ranks.

    Args:
        input_size: input features (full).
        output_sizes: full output rows of each shard.
        shard_ids, bias, dtype: as :class:`MergedLinear`.
        tp: the tensor-parallel group.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        shard_ids: Sequence[Hashable],
        bias: bool = False,
        dtype: torch.dtype | None = None,
        tp: TPGroup | None = None,
    ):
        self.tp_rank, self.tp_world = tp_rank_world(tp)
        local = [
            divide(s, self.tp_world, f"shard {i} rows") for i, s in zip(shard_ids, output_sizes)
        ]
        super().__init__(input_size, local, shard_ids, bias=bias, dtype=dtype)

    def load_weight(
        self, param_name: str, loaded: torch.Tensor, shard_id: Hashable | None = None
    ) -> None:
        """Load this rank's rows of one full checkpoint shard (:func:`shard_rows`)."""
        loaded = shard_rows(self, param_name, loaded, shard_id, self.tp_rank, self.tp_world)
        super().load_weight(param_name, loaded, shard_id)


class QKVParallelLinear(QKVLinear):
    """Merged q/k/v with the heads split across ranks: each rank holds ``num_heads / N`` query
    heads and ``num_kv_heads / N`` KV heads.

    Raises:
        ValueError: ``num_heads`` or ``num_kv_heads`` does not divide by the rank count (no
            silent replication of KV heads).
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        tp: TPGroup | None = None,
    ):
        self.tp_rank, self.tp_world = tp_rank_world(tp)
        heads = divide(num_heads, self.tp_world, "num_attention_heads")
        kv_heads = divide(num_kv_heads, self.tp_world, "num_key_value_heads")
        super().__init__(hidden_size, head_dim, heads, kv_heads, bias=bias, dtype=dtype)

    def load_weight(
        self, param_name: str, loaded: torch.Tensor, shard_id: Hashable | None = None
    ) -> None:
        """Load this rank's rows of one full checkpoint shard (:func:`shard_rows`)."""
        loaded = shard_rows(self, param_name, loaded, shard_id, self.tp_rank, self.tp_world)
        super().load_weight(param_name, loaded, shard_id)


class RowParallelLinear(Linear):
    """``y = all_reduce(x_local @ W_local.T) + b``: the input columns split across ranks, the
    partial products summed; the bias is added once, after the sum.

    Args:
        input_size: full input features (each rank gets ``input_size / N``).
        output_size, bias, dtype: as :class:`Linear`.
        tp: the tensor-parallel group.
        reduce: False returns this rank's partial sum and leaves the all-reduce to the caller
            (the fused all-reduce + residual add + RMSNorm); the bias then goes into rank 0's
            partial sum only, so that the sum holds it once (as vLLM's ``RowParallelLinear``).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        tp: TPGroup | None = None,
        reduce: bool = True,
    ):
        self.tp_rank, self.tp_world = tp_rank_world(tp)
        super().__init__(divide(input_size, self.tp_world, "row-parallel input size"), output_size,
                         bias=bias, dtype=dtype)  # fmt: skip
        self.tp = tp
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.reduce:
            return linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        y = all_reduce(linear(x, self.weight), self.tp)
        return y if self.bias is None else y + self.bias

    def load_weight(
        self, param_name: str, loaded: torch.Tensor, shard_id: Hashable | None = None
    ) -> None:
        if param_name == "weight":
            loaded = rank_slice(loaded, 1, self.tp_rank, self.tp_world, param_name)
        super().load_weight(param_name, loaded, shard_id)


@dataclass(frozen=True)
class VocabRange:
    """A vocabulary split into ``world`` contiguous ranges of ``ceil(vocab / world)`` rows (the
    last one padded); this rank holds rows ``start .. start + per_rank`` of the full
    ``[vocab, hidden]`` weight.

    Attributes:
        vocab: the full vocabulary size.
        rank, world: this rank and the rank count (0 and 1 without TP).
        per_rank: rows each rank holds.
        start: this rank's first row.
    """

    vocab: int
    rank: int
    world: int
    per_rank: int
    start: int

    @classmethod
    def of(cls, vocab: int, tp: TPGroup | None) -> VocabRange:
        """The range of this rank of ``tp`` (None: the whole vocabulary)."""
        rank, world = tp_rank_world(tp)
        per_rank = -(-vocab // world)
        return cls(vocab, rank, world, per_rank, rank * per_rank)

    def load(self, weight: torch.nn.Parameter, loaded: torch.Tensor, owner: str) -> None:
        """Copy this rank's rows of the full ``[vocab, hidden]`` ``loaded`` into ``weight``
        (``[per_rank, hidden]``), zeroing the padding rows.

        Raises:
            ValueError: a shape or dtype that does not match (``copy_weight``'s message).
        """
        rows = loaded[self.start : self.start + weight.shape[0]]
        with torch.no_grad():
            weight.zero_()
        copy_weight(weight.narrow(0, 0, rows.shape[0]), rows, f"{owner}.weight")


def load_vocab_weight(layer: torch.nn.Module, param_name: str, shard_id: Hashable | None) -> None:
    """Refuse anything but the one full ``weight`` of a vocabulary-parallel ``layer``.

    Raises:
        KeyError: another parameter name, or a shard id.
    """
    if param_name != "weight" or shard_id is not None:
        raise KeyError(f"{type(layer).__name__} has only 'weight'")


class VocabParallelEmbedding(VocabEmbedding):
    """The vocabulary in ``N`` contiguous ranges (padded up to a multiple of ``N``); ids outside
    this rank's range look up zeros, and an all-reduce sums the ranks."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        dtype: torch.dtype | None = None,
        tp: TPGroup | None = None,
    ):
        self.vocab_range = VocabRange.of(num_embeddings, tp)
        self.tp_rank, self.tp_world = self.vocab_range.rank, self.vocab_range.world
        self.full_vocab, self.vocab_start = num_embeddings, self.vocab_range.start
        self.tp = tp
        super().__init__(self.vocab_range.per_rank, embedding_dim, dtype=dtype)

    def load_weight(
        self, param_name: str, loaded: torch.Tensor, shard_id: Hashable | None = None
    ) -> None:
        """Load this rank's rows of the full checkpoint ``weight`` (see :meth:`load_full`)."""
        load_vocab_weight(self, param_name, shard_id)
        self.load_full(loaded)

    def load_full(self, loaded: torch.Tensor) -> None:
        """Load this rank's rows of the full ``[vocab, hidden]`` weight (pad rows zero)."""
        self.vocab_range.load(self.weight, loaded, type(self).__name__)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_world == 1:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return all_reduce(out, self.tp)


class ParallelLMHead(LMHead):
    """Each rank computes the logits of its vocabulary range; :meth:`forward` all-gathers them
    and drops the padding, so every rank gets ``[N, vocab]``."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype | None = None,
        tp: TPGroup | None = None,
    ):
        self.vocab_range = VocabRange.of(vocab_size, tp)
        self.tp_rank, self.tp_world = self.vocab_range.rank, self.vocab_range.world
        self.full_vocab, self.vocab_start = vocab_size, self.vocab_range.start
        self.tp = tp
        super().__init__(self.vocab_range.per_rank, hidden_size, dtype=dtype)

    def load_weight(
        self, param_name: str, loaded: torch.Tensor, shard_id: Hashable | None = None
    ) -> None:
        """Load this rank's rows of the full checkpoint ``weight`` (see :meth:`load_full`)."""
        load_vocab_weight(self, param_name, shard_id)
        self.load_full(loaded)

    def load_full(self, loaded: torch.Tensor) -> None:
        """Load this rank's rows of the full ``[vocab, hidden]`` weight (pad rows zero)."""
        self.vocab_range.load(self.weight, loaded, type(self).__name__)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        local = linear(hidden_states, self.weight, out_dtype=torch.float32)
        return all_gather_last_dim(local, self.tp)[..., : self.full_vocab]
