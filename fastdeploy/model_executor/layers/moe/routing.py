"""Expert selection: router logits -> the top-k experts of every token and their weights.

Everything runs on the device with fixed shapes (softmax/sigmoid, ``topk``, ``gather``,
``scatter``); nothing reads a value on the host, so routing can be captured in a CUDA graph.

The three routers we serve, as ``transformers`` implements them (``Qwen3MoeTopKRouter``,
``Glm4MoeTopkRouter``, ``Ernie4_5_MoeTopKRouter``):

- Qwen3-MoE: softmax over the experts, top-k, optionally renormalised to sum 1
  (``norm_topk_prob``).
- GLM-4-MoE (the DeepSeek-V3 router, DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", sec. 2.1.2):
  sigmoid scores; ``e_score_correction_bias`` is added for the *choice* only (auxiliary-loss-free
  load balancing); experts are chosen inside the ``topk_group`` best of ``n_group`` groups, a group
  scored by the sum of its two best biased scores; the chosen (unbiased) scores are renormalised
  (``+ 1e-20``) and multiplied by ``routed_scaling_factor``.
- ERNIE-4.5-MoE: softmax; the choice uses ``probs + e_score_correction_bias``; the chosen
  (unbiased) probabilities are divided by ``max(sum, moe_norm_min)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCORINGS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoERouting:
    """How a router turns logits into expert weights.

    Attributes:
        top_k: experts per token (``num_experts_per_tok``).
        scoring: ``"softmax"`` or ``"sigmoid"`` over the experts' logits.
        renormalize: divide the chosen scores by their sum.
        norm_eps: added to that sum (GLM: 1e-20).
        norm_min: the sum is clamped to at least this (ERNIE: ``moe_norm_min``); 0: no clamp.
        num_groups / topk_groups: grouped selection (GLM ``n_group`` / ``topk_group``); 1 / 1 is
            plain top-k.
        routed_scaling_factor: the final weights are multiplied by it.

    Raises:
        ValueError: a field out of range (the message names it).
    """

    top_k: int
    scoring: str = "softmax"
    renormalize: bool = False
    norm_eps: float = 0.0
    norm_min: float = 0.0
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise ValueError(f"scoring={self.scoring!r} is invalid; allowed: {SCORINGS}")
        if self.top_k < 1:
            raise ValueError(f"top_k={self.top_k} must be >= 1")
        if self.num_groups < 1 or not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(
                f"num_groups={self.num_groups}, topk_groups={self.topk_groups}: need "
                "1 <= topk_groups <= num_groups"
            )

    def check(self, num_experts: int) -> None:
        """Raise ``ValueError`` if this routing cannot work over ``num_experts`` experts."""
        if self.top_k > num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={num_experts}")
        if num_experts % self.num_groups:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by num_groups={self.num_groups}"
            )
        per_group = num_experts // self.num_groups
        if self.num_groups > 1 and (per_group < 2 or self.topk_groups * per_group < self.top_k):
            raise ValueError(
                f"grouped routing needs >= 2 experts per group and topk_groups * group size "
                f">= top_k; got {self.num_groups} groups of {per_group}, "
                f"topk_groups={self.topk_groups}, top_k={self.top_k}"
            )


def select_experts(
    router_logits: torch.Tensor,
    routing: MoERouting,
    correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose ``top_k`` experts per token.

    Args:
        router_logits: ``[T, E]``, any float dtype (computed in float32).
        routing: the router's rules.
        correction_bias: float32 ``[E]`` added to the scores for the choice only, or None.

    Returns:
        ``(weights, ids)``: float32 ``[T, top_k]`` and int64 ``[T, top_k]``; the ids of a token
        are distinct.
    """
    logits = router_logits.float()
    if routing.scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        scores = logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if routing.num_groups > 1:
        choice = _mask_to_best_groups(choice, routing.num_groups, routing.topk_groups)
    ids = torch.topk(choice, routing.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if routing.renormalize:
        denom = weights.sum(dim=-1, keepdim=True) + routing.norm_eps
        if routing.norm_min > 0:
            denom = denom.clamp(min=routing.norm_min)
        weights = weights / denom
    if routing.routed_scaling_factor != 1.0:
        weights = weights * routing.routed_scaling_factor
    return weights, ids


def _mask_to_best_groups(choice: torch.Tensor, num_groups: int, topk_groups: int) -> torch.Tensor:
    """``choice [T, E]`` with the experts outside each token's ``topk_groups`` best groups set
    to ``-inf``; a group scores the sum of its two best entries (DeepSeek-V3's node-limited
    routing)."""
    t, e = choice.shape
    grouped = choice.view(t, num_groups, e // num_groups)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
    best = group_scores.topk(topk_groups, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, e)
