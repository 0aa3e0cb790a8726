"""Token embedding and the language-model head (optionally tied to the embedding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastdeploy.model_executor.layers.linear import linear


class VocabEmbedding(nn.Module):
    """Token ids ``[T]`` int64 -> ``[T, embedding_dim]`` in the parameter dtype.

    Args:
        num_embeddings: vocabulary size.
        embedding_dim: hidden size.
        dtype: parameter dtype.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class LMHead(nn.Module):
    """Hidden states ``[N, hidden]`` -> float32 logits ``[N, vocab]``: the products are summed in
    float32 and not rounded to the parameter dtype (:func:`~fastdeploy.model_executor.layers.
    linear.linear_float32` says why: bf16 logits turn near-ties into exact ties).

    With tied embeddings (:meth:`tie_to`) the head shares the embedding's weight Parameter, so
    loading the embedding loads the head and checkpoints need no ``lm_head.weight``.
    """

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype))
        self.tied = False

    def tie_to(self, embedding: VocabEmbedding) -> None:
        """Share ``embedding.weight`` (shapes must match)."""
        if embedding.weight.shape != self.weight.shape:
            raise ValueError(
                f"cannot tie lm_head {tuple(self.weight.shape)} to the embedding "
                f"{tuple(embedding.weight.shape)}"
            )
        self.weight = embedding.weight
        self.tied = True

    def forward(self, hidden_states: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``[N, hidden]`` (the weight's dtype) -> float32 ``[N, vocab]``; into ``out``
        (float32 ``[N, vocab]``) when given (a decode graph writes its rows of one shared logits
        buffer)."""
        return linear(hidden_states, self.weight, out=out, out_dtype=torch.float32)

    def extra_repr(self) -> str:
        return f"{self.hidden_size} -> {self.vocab_size}, tied={self.tied}"
