"""The fused mixture-of-experts op: ``(hidden [T, H], router logits [T, E]) -> [T, H]``.

Each token goes through its ``top_k`` experts (SwiGLU MLPs, Shazeer 2020) and the outputs are
summed with the router's weights. Everything runs on the device with shapes that depend only on
``T``, so the op can be captured in a CUDA graph for any ``T`` up to a bucket size:

1. :func:`~fastdeploy.model_executor.layers.moe.routing.select_experts` picks the experts.
2. The ``N = T * top_k`` (token, expert) pairs are sorted by expert (a stable ``torch.sort``);
   each expert's rows end at ``searchsorted(sorted_ids, e, right=True)``, an int tensor that stays
   on the device (no ``bincount``, which reads its maximum on the host, and no ``nonzero``).
3. Two grouped GEMMs run the experts over their contiguous rows:

   - ``grouped_mm``: ``torch._grouped_mm`` with those offsets. On CUDA it is used only where
     torch's CUTLASS kernel runs (bf16 on compute capability 9.x/10.x with 16-byte aligned
     strides): torch's other CUDA path copies the offsets to the host, which breaks capture.
     On CPU torch's implementation loops over the groups on the host, which is fine there.
   - ``padded_bmm``: every expert gets a slot for each of the ``T`` tokens (a token picks an
     expert at most once, so no pair is ever dropped); rows are gathered into
     ``[experts, T, H]`` and run through ``torch.bmm``, in chunks of experts so the workspace
     stays under :data:`PADDED_BMM_WORKSPACE_BYTES`. It costs ``E / top_k`` times the FLOPs of
     the grouped path and is the device-side fallback everywhere else.

4. The rows are put back in (token, k) order and combined with one batched matmul
   ``[T, 1, k] @ [T, k, H]`` (a fixed-order reduction: the same bits every run, unlike
   ``index_add_``'s atomics).

Padding rows of a bucket (token id 0, slot -1) are routed like any token. No expert has a capacity
limit, so a row's output depends on that row only: padding cannot change a real token's output.
:func:`fused_moe_reference` is the plain loop over experts used as the test oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastdeploy.model_executor.layers.moe.routing import MoERouting, select_experts

BACKENDS = ("grouped_mm", "padded_bmm")
#: Upper bound of the padded-bmm workspace of one chunk of experts (bytes).
PADDED_BMM_WORKSPACE_BYTES = 256 << 20


def grouped_mm_available(device: torch.device, dtype: torch.dtype, sizes: tuple[int, ...]) -> bool:
    """Whether ``torch._grouped_mm`` can run the experts of this device/dtype capturably.

    Args:
        device: the weights' device.
        dtype: the activation and weight dtype.
        sizes: the GEMM dimensions (hidden size, intermediate size, 2 * intermediate size);
            each row must be a multiple of 16 bytes.
    """
    if not hasattr(torch, "_grouped_mm"):
        return False
    elem = torch.empty((), dtype=dtype).element_size()
    if any((s * elem) % 16 for s in sizes):
        return False
    if device.type == "cpu":
        return dtype in (torch.float32, torch.bfloat16)
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] in (9, 10)
    return False


def default_backend(w13: torch.Tensor, w2: torch.Tensor) -> str:
    """``grouped_mm`` where :func:`grouped_mm_available`, else ``padded_bmm``."""
    hidden, inter = w2.shape[1], w2.shape[2]
    ok = grouped_mm_available(w13.device, w13.dtype, (hidden, inter, 2 * inter))
    return "grouped_mm" if ok else "padded_bmm"


def fused_moe(
    hidden: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    routing: MoERouting,
    correction_bias: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Route every token to its experts and return the weighted sum of their outputs.

    Args:
        hidden: ``[T, H]`` activations (model dtype).
        router_logits: ``[T, E]`` (any float dtype).
        w13: ``[E, 2I, H]``, per expert the gate rows then the up rows (``transformers``'
            ``experts.gate_up_proj`` layout), model dtype.
        w2: ``[E, H, I]`` down projections (``experts.down_proj``).
        routing: the router's rules.
        correction_bias: float32 ``[E]`` selection bias, or None.
        backend: ``grouped_mm``, ``padded_bmm`` or None (:func:`default_backend`).

    Returns:
        ``[T, H]`` in ``hidden``'s dtype.

    Raises:
        ValueError: mismatched shapes or an unknown backend.
    """
    _check_shapes(hidden, router_logits, w13, w2)
    weights, ids = select_experts(router_logits, routing, correction_bias)
    return fused_experts(hidden, w13, w2, weights, ids, backend)


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    backend: str | None = None,
) -> torch.Tensor:
    """The experts part of :func:`fused_moe`, given the routing.

    Args:
        hidden: ``[T, H]``; w13 ``[E, 2I, H]``; w2 ``[E, H, I]`` (see :func:`fused_moe`).
        topk_weights: ``[T, k]`` (any float dtype; cast to ``hidden``'s for the combine).
        topk_ids: int64 ``[T, k]``, distinct experts per token.
        backend: as :func:`fused_moe`.

    Returns:
        ``[T, H]`` in ``hidden``'s dtype.
    """
    backend = default_backend(w13, w2) if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"MoE backend {backend!r} is unknown; valid: {BACKENDS}")
    t, h = hidden.shape
    k = topk_ids.shape[1]
    num_experts = w13.shape[0]
    sorted_ids, order = torch.sort(topk_ids.reshape(-1), stable=True)
    x = hidden.index_select(0, order // k)  # [N, H], grouped by expert
    experts = torch.arange(num_experts, device=hidden.device, dtype=sorted_ids.dtype)
    ends = torch.searchsorted(sorted_ids, experts, right=True)  # [E] end row of each expert
    if backend == "grouped_mm":
        y = _grouped_mm_experts(x, w13, w2, ends)
    else:
        y = _padded_bmm_experts(x, w13, w2, sorted_ids, ends, t)
    rows = torch.empty_like(y).index_copy_(0, order, y)  # back to (token, k) order
    out = torch.bmm(topk_weights.to(y.dtype).unsqueeze(1), rows.view(t, k, h))
    return out.view(t, h)


def _silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def _grouped_mm_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ends: torch.Tensor
) -> torch.Tensor:
    offs = ends.to(torch.int32)
    h = torch._grouped_mm(x, w13.transpose(1, 2), offs=offs)  # [N, 2I]
    return torch._grouped_mm(_silu_and_mul(h), w2.transpose(1, 2), offs=offs)  # [N, H]


def _padded_bmm_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    sorted_ids: torch.Tensor,
    ends: torch.Tensor,
    capacity: int,
) -> torch.Tensor:
    """Experts as batched matmuls over ``capacity`` (= T) slots each; ``x`` grouped by expert."""
    n, h = x.shape
    num_experts, inter = w2.shape[0], w2.shape[2]
    starts = torch.cat((ends.new_zeros(1), ends[:-1]))
    counts = ends - starts
    rank = torch.arange(n, device=x.device) - starts[sorted_ids]  # row within its expert
    x_ext = torch.cat((x, x.new_zeros(1, h)))  # row n: zeros for empty slots
    slot = torch.arange(capacity, device=x.device)
    per_expert = capacity * (2 * h + 3 * inter) * x.element_size()
    chunk = max(1, min(num_experts, PADDED_BMM_WORKSPACE_BYTES // per_expert))
    y = None
    for e0 in range(0, num_experts, chunk):
        c = min(chunk, num_experts - e0)
        src = starts[e0 : e0 + c, None] + slot
        src = torch.where(slot < counts[e0 : e0 + c, None], src, n)
        xb = x_ext[src]  # [c, capacity, H]
        hb = torch.bmm(xb, w13[e0 : e0 + c].transpose(1, 2))
        yb = torch.bmm(_silu_and_mul(hb), w2[e0 : e0 + c].transpose(1, 2))
        yb = torch.cat((yb.reshape(c * capacity, h), yb.new_zeros(1, h)))
        local = sorted_ids - e0
        inside = (local >= 0) & (local < c)
        part = yb[torch.where(inside, local * capacity + rank, c * capacity)]
        y = part if y is None else y + part
    return y


def fused_moe_reference(
    hidden: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    routing: MoERouting,
    correction_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The test oracle: a plain loop over the experts in float32 (reads counts on the host; not
    capturable). Same arguments and result as :func:`fused_moe`."""
    _check_shapes(hidden, router_logits, w13, w2)
    weights, ids = select_experts(router_logits, routing, correction_bias)
    inter = w2.shape[2]
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for e in range(w13.shape[0]):
        token, pos = (ids == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        gate_up = hidden[token].float() @ w13[e].float().t()
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, token, (act @ w2[e].float().t()) * weights[token, pos, None])
    return out.to(hidden.dtype)


def _check_shapes(
    hidden: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> None:
    if hidden.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"expected hidden [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(hidden.shape)}, "
            f"{tuple(w13.shape)}, {tuple(w2.shape)}"
        )
    t, h = hidden.shape
    e, h2, inter = w2.shape
    if tuple(w13.shape) != (e, 2 * inter, h) or h2 != h:
        raise ValueError(
            f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit hidden size {h}"
        )
    if tuple(router_logits.shape) != (t, e):
        raise ValueError(f"router_logits must be [{t}, {e}], got {tuple(router_logits.shape)}")
