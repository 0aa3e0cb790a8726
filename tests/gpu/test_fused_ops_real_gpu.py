"""Each fast op of a bf16 step on the real default model's own activations, against float32.

Random weights cannot show a precision defect (their logits are near-uniform, so almost every
position is a near-tie); these tests take the inputs every op really sees: the bf16 activations of
SmolLM2-135M-Instruct (the default GGUF) on a 571-token English text, recorded from the torch
reference path. Each fused op then runs on those inputs and is compared with the same formula in
float64 on the same bf16 inputs:

* RMSNorm, fused add + RMSNorm (flashinfer), RoPE (flashinfer), the RoPE + KV-write Triton kernel
  and SiLU-and-multiply (flashinfer) round once, so they are within half a bf16 ulp of float64
  (floored at 2^-9 of the row's largest value, where a rotation cancels), and never further from
  it than the torch reference, which rounds after each op;
* the LM head returns float32 logits within 2e-3 of float64 (float32 sums over 576 products;
  measured 2.2e-5 to 3.7e-5 on an H200). Before 2026-12-04 it returned bf16 logits, which this
  test refuses (their rounding alone is up to 0.0625 at logits of 16 to 32); on the fused path
  the France chat's first-token margin of "The" over "L" (0.082 nats in HF float32) then became
  an exact tie, which argmax broke towards "L" ("L'Étoile, la Marseillaise, ..."). Every other
  op here was already within half an ulp: the bisect found no fused-kernel defect.

One pytest call on a CUDA host with the GGUF (``.device/env.sh`` exports ``FD_TEST_GGUF``):
``python -m pytest -q -s tests/gpu/test_fused_ops_real_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
from real_model import SlotRunner

from fastdeploy.model_executor.forward_meta import ForwardMeta
from fastdeploy.model_executor.layers import fused_ops
from fastdeploy.model_executor.layers.activation import SiluAndMul
from fastdeploy.model_executor.layers.normalization import RMSNorm
from fastdeploy.model_executor.layers.rotary_embedding import RotaryEmbedding, _RotateThenStore
from fastdeploy.model_executor.model_loader import get_model
from fastdeploy.model_executor.model_loader.source import resolve_model

pytestmark = [
    pytest.mark.skipif(
        fused_ops.why_not_fused("cuda") is not None, reason="needs flashinfer and FD_USE_FUSED_OPS"
    ),
]

TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
    "age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the "
    "season of Light, it was the season of Darkness, it was the spring of hope, it was the winter "
    "of despair, we had everything before us, we had nothing before us, we were all going direct "
    "to Heaven, we were all going direct the other way. In short, the period was so far like the "
    "present period, that some of its noisiest authorities insisted on its being received, for "
    "good or for evil, in the superlative degree of comparison only. There were a king with a "
    "large jaw and a queen with a plain face, on the throne of England; there were a king with a "
    "large jaw and a queen with a fair face, on the throne of France. "
) * 3  # Dickens, "A Tale of Two Cities" (1859), public domain


@pytest.fixture(scope="module")
def recorded(real_gguf):
    """The bf16 model and each op's inputs on one prefill of :data:`TEXT`, recorded from the
    torch reference path (every fused op off)."""
    source = resolve_model(real_gguf, "auto")
    model = get_model(source, torch.bfloat16, "cuda", 0)
    ids = source.load_tokenizer().encode(TEXT, add_special_tokens=False)
    calls = {"norm": [], "addnorm": [], "rope": [], "silu": [], "head": []}

    def norm(self, x, residual=None):
        kind = "norm" if residual is None else "addnorm"
        calls[kind].append((self, x.clone(), None if residual is None else residual.clone()))
        return self.forward_native(x, residual)

    def rope(self, positions, q, k, v, cache, slots):
        calls["rope"].append((self, positions.clone(), q.clone(), k.clone(), v.clone()))
        return _RotateThenStore.forward_and_store(self, positions, q, k, v, cache, slots)

    def silu(self, x):
        calls["silu"].append((self, x.clone()))
        return self.forward_native(x)

    patches = {
        (RMSNorm, "forward"): norm,
        (RotaryEmbedding, "forward_and_store"): rope,
        (SiluAndMul, "forward"): silu,
    }
    saved = {key: getattr(*key) for key in patches}
    try:
        for (cls, name), fn in patches.items():
            setattr(cls, name, fn)
        runner = SlotRunner(model, num_blocks=64)
        with torch.inference_mode():
            batch, input_ids, positions = runner.build_batch([("text", ids)])
            meta = ForwardMeta(
                runner.backend, runner.backend.build_metadata(batch), runner.kv_caches,
                slot_mapping=batch.slot_mapping,
            )  # fmt: skip
            calls["head"].append(model(input_ids, positions, meta).clone())
    finally:
        for (cls, name), fn in saved.items():
            setattr(cls, name, fn)
    assert len(ids) > 500 and len(calls["addnorm"]) == 2 * model.config.num_hidden_layers
    return model, calls


def _half_ulp_errors(out: torch.Tensor, exact: torch.Tensor) -> float:
    """Largest ``|out - exact|`` in units of half a bf16 ulp of ``exact`` (2^-9 relative),
    floored at 2^-9 of the row's largest value."""
    scale = exact.abs().amax(-1, keepdim=True)
    mag = torch.maximum(exact.abs(), scale / 2).clamp_min(1e-30)
    half_ulp = torch.pow(2.0, torch.floor(torch.log2(mag)) - 8)
    return float(((out.double() - exact).abs() / half_ulp).max())


def _check(what: str, fused: torch.Tensor, native: torch.Tensor, exact: torch.Tensor) -> None:
    e_fused, e_native = _half_ulp_errors(fused, exact), _half_ulp_errors(native, exact)
    print(f"{what}: max error {e_fused:.3f} half-ulps fused, {e_native:.3f} torch reference")
    # 1%: float32 arithmetic (flashinfer's approximate rsqrt and exp) at a rounding midpoint
    assert e_fused <= 1.01, (what, e_fused)
    assert e_fused <= e_native + 0.01, (what, e_fused, e_native)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


@torch.inference_mode()
def test_rmsnorm_on_real_activations(recorded):
    _, calls = recorded
    for i, (norm, x, _) in enumerate(calls["norm"]):
        exact = _rms(x.double(), norm.weight, norm.eps)
        _check(f"rmsnorm {i}", norm(x.clone()), norm.forward_native(x), exact)


@torch.inference_mode()
def test_fused_add_rmsnorm_on_real_activations(recorded):
    """Also the new residual: the bf16 sum, rounded once (the residual stream of this model
    reaches 2e4, where one bf16 ulp is 128)."""
    _, calls = recorded
    for i, (norm, x, res) in enumerate(calls["addnorm"]):
        total = x.double() + res.double()
        out, new_res = norm(x.clone(), res.clone())
        ref_out, ref_res = norm.forward_native(x, res)
        _check(f"add+rmsnorm {i}", out, ref_out, _rms(total, norm.weight, norm.eps))
        assert torch.equal(new_res, ref_res), i


def _rope_exact(rope: RotaryEmbedding, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """neox RoPE of ``x [T, heads * head_dim]`` in float64 with the layer's cos/sin."""
    half = rope.rotary_dim // 2
    cs = rope.cos_sin_cache[positions].double().unsqueeze(1)
    cos, sin = cs[..., :half], cs[..., half:]
    h = x.double().view(x.shape[0], -1, rope.head_dim)
    a, b = h[..., :half], h[..., half : 2 * half]
    return torch.cat((a * cos - b * sin, b * cos + a * sin, h[..., 2 * half :]), -1).flatten(1)


@torch.inference_mode()
def test_rope_and_rope_kv_write_on_real_activations(recorded):
    """flashinfer's in-place RoPE and the Triton RoPE + KV write, on each layer's real q/k; the
    cache then holds exactly the rotated k and the v."""
    _, calls = recorded
    for i, (rope, positions, q, k, v) in enumerate(calls["rope"]):
        ex_q, ex_k = (_rope_exact(rope, positions, x) for x in (q, k))
        nat_q, nat_k = rope.forward_native(positions, q, k)
        fq, fk = rope(positions, q.clone(), k.clone())
        _check(f"rope q {i}", fq, nat_q, ex_q)
        _check(f"rope k {i}", fk, nat_k, ex_k)
        kv_heads = k.shape[1] // rope.head_dim
        cache = torch.zeros(64, 2, 16, kv_heads, rope.head_dim, dtype=k.dtype, device="cuda")
        slots = torch.arange(q.shape[0], device="cuda")
        tq, tk = rope.forward_and_store(positions, q.clone(), k.clone(), v.clone(), cache, slots)
        _check(f"rope+kv q {i}", tq, nat_q, ex_q)
        _check(f"rope+kv k {i}", tk, nat_k, ex_k)
        stored = cache.transpose(0, 1).reshape(2, -1, k.shape[1])[:, : q.shape[0]]
        assert torch.equal(stored[0], tk) and torch.equal(stored[1], v), i


@torch.inference_mode()
def test_silu_and_mul_on_real_activations(recorded):
    _, calls = recorded
    for i, (act, x) in enumerate(calls["silu"]):
        d = x.shape[-1] // 2
        xd = x.double()
        exact = torch.nn.functional.silu(xd[..., :d]) * xd[..., d:]
        _check(f"silu_and_mul {i}", act(x.clone()), act.forward_native(x), exact)


@torch.inference_mode()
def test_lm_head_returns_unrounded_float32_logits(recorded):
    """The LM head on the real final hidden states (eager, and through a persistent float32
    buffer as a decode graph writes it): float32 logits within 2e-3 of float64. Failed before
    2026-12-04, when the head returned bf16 logits."""
    model, calls = recorded
    hidden = calls["head"][0]
    exact = hidden.double() @ model.lm_head.weight.double().t()
    for rows in (1, 7, 16, hidden.shape[0]):
        logits = model.compute_logits(hidden[:rows])
        assert logits.dtype == torch.float32
        err = float((logits.double() - exact[:rows]).abs().max())
        print(f"lm head, {rows} rows: max |logit - float64| {err:.2e}")
        assert err <= 2e-3, (rows, err)
        out = torch.empty(rows, model.vocab_size, dtype=torch.float32, device="cuda")
        assert model.compute_logits(hidden[:rows], out=out).data_ptr() == out.data_ptr()
        assert float((out.double() - exact[:rows]).abs().max()) <= 2e-3
