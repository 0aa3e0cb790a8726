"""The fused MoE op and the routers on CPU: both backends equal the plain loop over experts,
padding rows change no real row, the routers equal ``transformers``' routers, and the op has no
data-dependent shape (it runs on the meta device and traces into one dynamo graph), which is what
lets CUDA graphs capture it."""

from __future__ import annotations

import importlib

import pytest
import torch
import transformers

from fastdeploy.model_executor.layers.moe import (
    BACKENDS,
    FusedMoEExperts,
    MoERouting,
    SparseMoeBlock,
    default_backend,
    fused_moe,
    fused_moe_reference,
    grouped_mm_available,
    select_experts,
)

# the module (its name is shadowed by the function in the package namespace)
fused_moe_module = importlib.import_module("fastdeploy.model_executor.layers.moe.fused_moe")

H, INTER, E, K = 64, 32, 8, 2
ROUTINGS = {
    "qwen3": MoERouting(K, "softmax", renormalize=True),
    "qwen3_no_norm": MoERouting(K, "softmax"),
    "glm4": MoERouting(
        K, "sigmoid", True, norm_eps=1e-20, num_groups=2, topk_groups=1, routed_scaling_factor=2.5
    ),
    "ernie": MoERouting(K, "softmax", True, norm_min=1e-12),
}


def weights(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * INTER, H, generator=g) * 0.15).to(dtype)
    w2 = (torch.randn(E, H, INTER, generator=g) * 0.15).to(dtype)
    bias = torch.randn(E, generator=g) * 0.1
    return w13, w2, bias


def inputs(t, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, H, generator=g).to(dtype), torch.randn(t, E, generator=g) * 2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("t", [1, 5, 37])
def test_backends_equal_the_loop_over_experts(backend, routing, t):
    w13, w2, bias = weights()
    x, logits = inputs(t)
    bias = bias if routing in ("glm4", "ernie") else None
    ref = fused_moe_reference(x, logits, w13, w2, ROUTINGS[routing], bias)
    out = fused_moe(x, logits, w13, w2, ROUTINGS[routing], bias, backend=backend)
    assert out.shape == (t, H) and out.dtype == torch.float32
    assert ref.abs().max() > 0.1  # the experts really contribute
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_close_to_the_float32_loop(backend):
    w13, w2, _ = weights(torch.bfloat16)
    x, logits = inputs(29, torch.bfloat16)
    ref = fused_moe_reference(x, logits, w13, w2, ROUTINGS["qwen3"]).float()
    out = fused_moe(x, logits, w13, w2, ROUTINGS["qwen3"], backend=backend)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=0.02, atol=0.02)


def test_padded_bmm_in_chunks_of_experts(monkeypatch):
    """A small workspace bound splits the experts into several bmm chunks: same result."""
    w13, w2, bias = weights()
    x, logits = inputs(21)
    whole = fused_moe(x, logits, w13, w2, ROUTINGS["glm4"], bias, backend="padded_bmm")
    per_expert = 21 * (2 * H + 3 * INTER) * 4
    monkeypatch.setattr(fused_moe_module, "PADDED_BMM_WORKSPACE_BYTES", 3 * per_expert)
    calls = []
    bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda a, b: calls.append(a.shape[0]) or bmm(a, b))
    chunked = fused_moe(x, logits, w13, w2, ROUTINGS["glm4"], bias, backend="padded_bmm")
    assert calls == [3, 3, 3, 3, 2, 2, 21]  # 3 chunks of experts (2 GEMMs each), the combine
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_rows_do_not_change_real_rows(backend):
    """A bucket's padding rows (all the same token, so all routed to the same experts) are added
    to a step: the real rows' outputs stay the same (no expert has a capacity to overflow)."""
    w13, w2, bias = weights()
    x, logits = inputs(13)
    pad_x = x[:1].expand(19, H) * 3
    pad_logits = torch.zeros(19, E)
    pad_logits[:, 5] = 50.0  # every padding row picks expert 5 first
    routing = ROUTINGS["qwen3"]
    alone = fused_moe(x, logits, w13, w2, routing, backend=backend)
    padded = fused_moe(
        torch.cat((x, pad_x)), torch.cat((logits, pad_logits)), w13, w2, routing, backend=backend
    )
    torch.testing.assert_close(padded[:13], alone, rtol=0, atol=1e-6)


def test_no_data_dependent_shapes_meta_device():
    """On the meta device values do not exist: an op that read a count on the host (``nonzero``,
    ``.item()``, boolean indexing) would fail, as the reference loop does."""
    dt = torch.bfloat16  # torch's meta kernel of _grouped_mm is bf16-only, like its CUDA kernel
    x = torch.empty(37, H, dtype=dt, device="meta")
    logits = torch.empty(37, E, device="meta")
    w13 = torch.empty(E, 2 * INTER, H, dtype=dt, device="meta")
    w2 = torch.empty(E, H, INTER, dtype=dt, device="meta")
    bias = torch.empty(E, device="meta")
    for backend in BACKENDS:
        out = fused_moe(x, logits, w13, w2, ROUTINGS["glm4"], bias, backend=backend)
        assert out.shape == (37, H) and out.device.type == "meta"
    with pytest.raises((NotImplementedError, RuntimeError)):
        fused_moe_reference(x, logits, w13, w2, ROUTINGS["glm4"], bias)


@pytest.mark.parametrize("backend", BACKENDS)
def test_traces_into_one_graph(backend):
    """``torch.compile(fullgraph=True)`` fails on any graph break (a host read): the op is one
    graph, the condition for capturing it inside a piecewise segment or a decode graph."""
    dt = torch.bfloat16
    w13, w2, bias = weights(dt)
    x, logits = inputs(11, dt)
    routing = ROUTINGS["ernie"]

    def op(x, logits):
        return fused_moe(x, logits, w13, w2, routing, bias, backend=backend)

    compiled = torch.compile(op, backend="eager", fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(x, logits), op(x, logits), rtol=0, atol=0)


def test_backend_choice():
    w13, w2, _ = weights()
    assert grouped_mm_available(torch.device("cpu"), torch.float32, (64, 32, 64))
    assert not grouped_mm_available(torch.device("cpu"), torch.float32, (64, 30, 60))  # 120 B rows
    assert not grouped_mm_available(torch.device("cpu"), torch.float16, (64, 32, 64))
    assert default_backend(w13, w2) == "grouped_mm"
    odd = torch.empty(E, 2 * 3, H), torch.empty(E, H, 3)
    assert default_backend(*odd) == "padded_bmm"
    with pytest.raises(ValueError, match="MoE backend 'triton' is unknown"):
        fused_moe(*inputs(2), w13, w2, ROUTINGS["qwen3"], backend="triton")
    with pytest.raises(ValueError, match=r"router_logits must be \[2, 8\]"):
        fused_moe(inputs(2)[0], torch.zeros(2, 4), w13, w2, ROUTINGS["qwen3"])


def test_routing_validation():
    with pytest.raises(ValueError, match="scoring='relu' is invalid"):
        MoERouting(2, "relu")
    with pytest.raises(ValueError, match="top_k=0"):
        MoERouting(0)
    with pytest.raises(ValueError, match="topk_groups"):
        MoERouting(2, num_groups=2, topk_groups=3)
    with pytest.raises(ValueError, match="top_k=9 exceeds num_experts=8"):
        MoERouting(9).check(8)
    with pytest.raises(ValueError, match="not divisible"):
        MoERouting(2, num_groups=3).check(8)


def _hf_router(name: str):
    """A ``transformers`` router with random weights and our routing of the same config."""
    common = dict(hidden_size=H, num_experts_per_tok=K, norm_topk_prob=True)
    if name == "qwen3":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

        router = Qwen3MoeTopKRouter(transformers.Qwen3MoeConfig(num_experts=E, **common))
    elif name == "glm4":
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

        cfg = transformers.Glm4MoeConfig(
            n_routed_experts=E, n_group=2, topk_group=1, routed_scaling_factor=2.5, **common
        )
        router = Glm4MoeTopkRouter(cfg)
    else:
        from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeTopKRouter

        cfg = transformers.Ernie4_5_MoeConfig(hidden_size=H, moe_num_experts=E, moe_k=K)
        router = Ernie4_5_MoeTopKRouter(cfg)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g) * 0.3)
    bias = torch.randn(E, generator=g) * 0.1
    if name == "glm4":
        router.e_score_correction_bias.copy_(bias)
    elif name == "ernie":
        with torch.no_grad():
            router.moe_statics.e_score_correction_bias.copy_(bias[None])
    else:
        bias = None
    return router, bias


@pytest.mark.parametrize("name", ["qwen3", "glm4", "ernie"])
def test_routers_equal_transformers(name):
    router, bias = _hf_router(name)
    x = torch.randn(50, H, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(x)
    weights_, ids = select_experts(logits, ROUTINGS[name], bias)
    hf_order, order = hf_ids.argsort(dim=-1), ids.argsort(dim=-1)
    assert torch.equal(hf_ids.gather(1, hf_order), ids.gather(1, order))
    torch.testing.assert_close(
        weights_.gather(1, order), hf_weights.float().gather(1, hf_order), rtol=0, atol=1e-6
    )
    assert ids.dtype == torch.int64 and weights_.dtype == torch.float32


def test_expert_weight_shards_load_and_export():
    experts = FusedMoEExperts(4, H, INTER, torch.float32)
    g = torch.Generator().manual_seed(5)
    gate, up, down = (torch.randn(4, *s, generator=g) for s in ((INTER, H), (INTER, H), (H, INTER)))
    for j in range(4):  # one matrix per expert, as on disk
        experts.load_weight("gate_up_proj", gate[j], ("gate", j))
        experts.load_weight("gate_up_proj", up[j], ("up", j))
        experts.load_weight("down_proj", down[j], ("down", j))
    assert torch.equal(experts.gate_up_proj, torch.cat((gate, up), dim=1))
    assert torch.equal(experts.export_weight("down_proj"), down)
    stacked = FusedMoEExperts(4, H, INTER, torch.float32)  # stacked per projection, as GGUF
    stacked.load_weight("gate_up_proj", gate, ("gate", None))
    stacked.load_weight("gate_up_proj", up, ("up", None))
    assert torch.equal(stacked.gate_up_proj, experts.gate_up_proj)
    assert torch.equal(experts.export_weight("gate_up_proj", ("up", 2)), up[2])
    with pytest.raises(ValueError, match="does not match"):
        experts.load_weight("down_proj", down[0].t(), ("down", 1))
    with pytest.raises(KeyError, match="expert 4 out of range"):
        experts.load_weight("down_proj", down[0], ("down", 4))
    with pytest.raises(KeyError, match="no shard"):
        experts.load_weight("down_proj", down[0], ("gate", 0))


def test_sparse_block_adds_shared_experts_and_checks_routing():
    shared = torch.nn.Linear(H, H, bias=False)
    block = SparseMoeBlock(
        H, INTER, E, ROUTINGS["glm4"], torch.float32, torch.float32, True, shared
    )
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    x = torch.randn(9, H, generator=g)
    experts = block.experts
    routed = fused_moe_reference(
        x,
        block.gate(x),
        experts.gate_up_proj,
        experts.down_proj,
        ROUTINGS["glm4"],
        block.gate.e_score_correction_bias,
    )
    with torch.no_grad():
        torch.testing.assert_close(block(x), routed + shared(x), rtol=0, atol=2e-6)
    assert block.resolved_backend() == "grouped_mm"
    with pytest.raises(ValueError, match="top_k=2 exceeds num_experts=1"):
        SparseMoeBlock(H, INTER, 1, ROUTINGS["qwen3"], torch.float32, torch.float32)
