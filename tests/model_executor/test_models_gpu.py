"""The models and the torch-native backend on a CUDA device (marker ``gpu``).

Run on a CUDA host: ``python3 -m pytest -q -m gpu tests/model_executor``. Tiny random models as
in ``test_tiny_models.py``, ours against transformers on the same device with the same weights.
Measured on an H200 (torch 2.11, transformers 5.17), max abs logit diff with logits up to ~7:
float32 3e-6 to 6e-6 (``FP32_ATOL`` 1e-4); bfloat16 0.086 to 0.155 (``BF16_ATOL`` 0.25: both
sides round every op to bf16, in different orders). In bf16 only the first greedy tokens are
compared, as a near-tie can flip a later one.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from paged_runner import PagedRunner
from test_tiny_models import build_pair

from fastdeploy.model_executor.model_loader import get_model
from fastdeploy.model_executor.model_loader.dummy_loader import export_hf_state_dict
from fastdeploy.model_executor.models.registry import resolve_model_class

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)", allow_module_level=True)

pytestmark = pytest.mark.gpu

FP32_ATOL = 1e-4
BF16_ATOL = 0.25
PROMPT = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(2)).tolist()


def hf_greedy(hf, ids, n):
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([ids], device="cuda"),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long, device="cuda"),
            do_sample=False,
            max_new_tokens=n,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["qwen3", "qwen2", "llama3_bias"])
def test_tiny_model_on_cuda_matches_hf(name, dtype):
    hf, ours = build_pair(name)
    hf, ours = hf.to("cuda", dtype), ours.to("cuda", dtype)
    _, logits = PagedRunner(ours, block_size=16).step([("r", PROMPT)])
    with torch.inference_mode():
        ref = hf(torch.tensor([PROMPT], device="cuda")).logits[0].float()
    diff = (logits - ref).abs().max().item()
    print(f"{name} {dtype}: max abs logit diff {diff:.3g}")
    assert diff < (FP32_ATOL if dtype == torch.float32 else BF16_ATOL)
    n = 24 if dtype == torch.float32 else 4
    tokens, _ = PagedRunner(ours, block_size=16).generate_greedy("r", PROMPT, n, set())
    assert tokens == hf_greedy(hf, PROMPT, n)


def test_dummy_weights_on_cuda_export_to_hf():
    cfg = transformers.Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
    )
    cfg.architectures = ["Qwen3ForCausalLM"]
    a = get_model("unused", "dummy", cfg, torch.float32, "cuda", 3)
    b = get_model("unused", "dummy", cfg, torch.float32, "cuda", 3)
    assert a.embed_tokens.weight.is_cuda and a.rotary_emb.cos_cache.is_cuda
    assert torch.equal(a.layers[1].qkv_proj.weight, b.layers[1].qkv_proj.weight)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).to("cuda").eval()
    hf.load_state_dict(export_hf_state_dict(a), strict=True)
    _, logits = PagedRunner(a).step([("r", PROMPT)])
    with torch.inference_mode():
        ref = hf(torch.tensor([PROMPT], device="cuda")).logits[0]
    assert (logits - ref).abs().max().item() < FP32_ATOL
    assert resolve_model_class(cfg) is type(a)
