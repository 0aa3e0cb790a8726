"""Tiny Qwen3-MoE, GLM-4-MoE, ERNIE-4.5 and ERNIE-4.5-MoE models (the ``tiny-*`` presets, every
routing feature of each family on): ours, given a ``transformers`` model's weights, gives its
logits and its greedy tokens, directly, through ``LLM`` from a saved checkpoint, from dummy
weights and from GGUF; padding rows of a piecewise bucket change no real token.

Weights are drawn wider than the usual 0.02 init (norms away from 1, routers spread out) so that
routing is decided by the weights. Measured max abs logit difference on CPU float32 (logits up to
~5): 2.6e-6 (Qwen3-MoE), 1.7e-6 (GLM-4-MoE), 0.0 (ERNIE-4.5), 1.9e-6 (ERNIE-4.5-MoE).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from paged_runner import PagedRunner

from fastdeploy import LLM, SamplingParams
from fastdeploy.model_executor.graph_optimization.piecewise import (
    PiecewiseGraph,
    SegmentBuffers,
    make_segments,
)
from fastdeploy.model_executor.layers.moe import SparseMoeBlock
from fastdeploy.model_executor.model_loader import get_model
from fastdeploy.model_executor.model_loader.dummy_loader import export_hf_state_dict
from fastdeploy.model_executor.model_loader.gguf_loader import gguf_to_hf_name
from fastdeploy.model_executor.model_loader.presets import PRESETS, write_preset
from fastdeploy.model_executor.model_loader.source import resolve_model
from fastdeploy.model_executor.models.registry import resolve_model_class

LOGITS_ATOL = 1e-4
TINY = ["tiny-qwen3-moe", "tiny-glm4-moe", "tiny-ernie4.5", "tiny-ernie4.5-moe"]
PROMPT = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(2)).tolist()


def hf_config(name: str, tmp_path_factory, **overrides):
    directory = write_preset(name, tmp_path_factory.mktemp(name))
    return transformers.AutoConfig.from_pretrained(directory, **overrides)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Parameters and the routers' correction biases (a buffer in GLM) drawn wide."""
    g = torch.Generator().manual_seed(seed)
    tensors = list(model.named_parameters())
    tensors += [(n, b) for n, b in model.named_buffers() if "e_score_correction_bias" in n]
    with torch.no_grad():
        for name, p in tensors:
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1 + 0.2 * noise)
            else:
                p.copy_(noise * (0.1 if p.ndim == 1 else 0.15))


def hf_model(cfg):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    randomize(hf, seed=1)
    return hf


def ours_from(hf, cfg):
    ours = resolve_model_class(cfg)(cfg, torch.float32)
    ours.load_weights(hf.state_dict().items())
    return ours.eval()


@torch.inference_mode()
def hf_logits(hf, ids):
    return hf(torch.tensor([ids])).logits[0]


@torch.inference_mode()
def hf_greedy(hf, prompt, n):
    out = hf.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=n,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module", params=TINY)
def pair(request, tmp_path_factory):
    cfg = hf_config(request.param, tmp_path_factory)
    hf = hf_model(cfg)
    return request.param, cfg, hf, ours_from(hf, cfg)


def test_prefill_logits_and_greedy_tokens_match_hf(pair):
    name, cfg, hf, ours = pair
    moe_layers = [i for i, layer in enumerate(ours.layers) if isinstance(layer.mlp, SparseMoeBlock)]
    expected = {
        "tiny-qwen3-moe": [0, 2],
        "tiny-glm4-moe": [1, 2],
        "tiny-ernie4.5": [],
        "tiny-ernie4.5-moe": [1, 2],
    }
    assert moe_layers == expected[name]
    _, logits = PagedRunner(ours, block_size=8).step([("r", PROMPT)])
    diff = (logits - hf_logits(hf, PROMPT)).abs().max().item()
    print(f"{name}: max |logit ours - transformers| = {diff:.2e}")
    assert diff < LOGITS_ATOL
    tokens, _ = PagedRunner(ours, block_size=8).generate_greedy("r", PROMPT, 24, set())
    assert tokens == hf_greedy(hf, PROMPT, 24)


def test_greedy_tokens_through_llm_from_a_saved_checkpoint(pair, tmp_path):
    """``save_pretrained`` writes the on-disk form (one matrix per expert, ERNIE's
    ``moe_statics``); ``LLM`` loads it and batches two prompts with chunked prefill."""
    name, cfg, hf, _ = pair
    hf.save_pretrained(tmp_path)
    llm = LLM(
        str(tmp_path),
        skip_tokenizer_init=True,
        max_model_len=256,
        block_size=16,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        seed=0,
    )
    prompts = [PROMPT, PROMPT[:37]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == [hf_greedy(hf, p, 12) for p in prompts]


@pytest.mark.parametrize("name", TINY)
def test_dummy_weights_export_to_transformers(name, tmp_path):
    source = resolve_model(write_preset(name, tmp_path), "dummy")
    model = get_model(source, torch.float32, "cpu", 0)
    for block in getattr(model, "moe_blocks", list)():
        assert block.gate.weight.dtype == torch.float32
        assert block.experts.gate_up_proj.std() > 0.015  # random, not left empty
    hf = transformers.AutoModelForCausalLM.from_config(source.hf_config).eval()
    hf.load_state_dict(export_hf_state_dict(model), strict=True)
    _, logits = PagedRunner(model).step([("r", PROMPT[:20])])
    assert (logits - hf_logits(hf, PROMPT[:20])).abs().max().item() < LOGITS_ATOL


def test_bfloat16_keeps_the_routers_in_float32(tmp_path_factory):
    cfg = hf_config("tiny-glm4-moe", tmp_path_factory)
    ours32 = ours_from(hf_model(cfg), cfg)
    ours16 = resolve_model_class(cfg)(cfg, torch.bfloat16)
    ours16.load_weights(ours32.hf_state_dict().items())
    block = ours16.moe_blocks()[0]
    assert block.gate.weight.dtype == block.gate.e_score_correction_bias.dtype == torch.float32
    assert block.experts.down_proj.dtype == torch.bfloat16
    ref, _ = PagedRunner(ours32).step([("r", PROMPT[:40])])
    got, _ = PagedRunner(ours16).step([("r", PROMPT[:40])])
    assert torch.allclose(got, ref, atol=0.5, rtol=0.05)


def test_piecewise_bucket_padding_changes_no_real_token(tmp_path_factory):
    """The segments of a 48-token bucket, run on a 41-token mixed step padded to 48 (token 0,
    slot -1), give the real tokens the hidden states of the unpadded forward."""
    cfg = hf_config("tiny-qwen3-moe", tmp_path_factory)
    model = ours_from(hf_model(cfg), cfg)
    chunks = [("a", PROMPT[:30]), ("b", PROMPT[50:61])]
    layer = model.layers[0]
    with torch.inference_mode():
        plain = PagedRunner(model, block_size=8)
        batch, ids, pos = plain.build_batch(chunks)
        meta = _meta(plain, batch)
        expected = model(ids, pos, meta)
        padded_runner = PagedRunner(model, block_size=8)
        batch, ids, pos = padded_runner.build_batch(chunks, pad_to=48)
        bufs = SegmentBuffers(
            64, 64, layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim,
            torch.float32, torch.device("cpu"),
        )  # fmt: skip
        segments = make_segments(model, bufs, ids, pos)
        graph = PiecewiseGraph(48, segments, bufs, [lyr.attn for lyr in model.layers])
        got = graph.run_eager(_meta(padded_runner, batch))
    assert got.shape[0] == 48 and ids[41:].eq(0).all()
    torch.testing.assert_close(got[:41], expected, rtol=0, atol=1e-5)


def _meta(runner, batch):
    from fastdeploy.model_executor.forward_meta import ForwardMeta

    return ForwardMeta(runner.backend, runner.backend.build_metadata(batch), runner.kv_caches)


def _write_qwen3moe_gguf(path, hf, cfg) -> None:
    """A float32 GGUF of ``hf`` named by the ``gguf`` package's own tensor map (qwen3moe)."""
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, cfg.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_expert_count(cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_vocab_size(cfg.vocab_size)
    inter = cfg.moe_intermediate_size
    for hf_name, tensor in hf.state_dict().items():
        parts = {hf_name: tensor}
        if hf_name.endswith("experts.gate_up_proj"):
            stem = hf_name.rpartition(".")[0]
            parts = {f"{stem}.gate_proj": tensor[:, :inter], f"{stem}.up_proj": tensor[:, inter:]}
        for name, t in parts.items():
            gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
            assert gguf_name is not None, name
            suffix = "" if name.endswith((".weight", ".bias")) else ".weight"
            writer.add_tensor(gguf_name + suffix, t.contiguous().numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_qwen3_moe_from_gguf(tmp_path_factory, tmp_path):
    """Every layer sparse (GGUF has no ``mlp_only_layers``); ``moe_intermediate_size`` comes from
    ``expert_feed_forward_length``, which ``transformers`` does not read."""
    cfg = hf_config("tiny-qwen3-moe", tmp_path_factory, mlp_only_layers=[])
    hf = hf_model(cfg)
    _write_qwen3moe_gguf(tmp_path / "tiny.gguf", hf, cfg)
    source = resolve_model(str(tmp_path / "tiny.gguf"))
    assert (
        source.hf_config.moe_intermediate_size == PRESETS["tiny-qwen3-moe"]["moe_intermediate_size"]
    )
    model = get_model(source, torch.float32, "cpu")
    assert len(model.moe_blocks()) == cfg.num_hidden_layers
    _, logits = PagedRunner(model).step([("r", PROMPT[:50])])
    assert (logits - hf_logits(hf, PROMPT[:50])).abs().max().item() < LOGITS_ATOL


@pytest.mark.parametrize(
    "arch, model_name",
    [
        ("QWEN3MOE", "tiny-qwen3-moe"),
        ("GLM4_MOE", "tiny-glm4-moe"),
        ("ERNIE4_5_MOE", "tiny-ernie4.5-moe"),
        ("ERNIE4_5", "tiny-ernie4.5"),
    ],
)
def test_gguf_names_of_the_gguf_package_load_into_our_models(arch, model_name, tmp_path_factory):
    """The ``gguf`` package names every weight of our model for the architecture, and our GGUF
    name mapping takes that name back to the same parameter."""
    import gguf

    overrides = {"mlp_only_layers": []} if arch == "QWEN3MOE" else {}  # llama.cpp has none
    cfg = hf_config(model_name, tmp_path_factory, **overrides)
    model = resolve_model_class(cfg)(cfg, torch.float32)
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch), cfg.num_hidden_layers)
    checked = set()
    for hf_name in model.hf_weight_names():
        stem, _, last = hf_name.rpartition(".")
        if last == "gate_up_proj":  # GGUF stacks gate and up separately: [E, I, H] each
            candidates = [f"{stem}.gate_proj.weight", f"{stem}.up_proj.weight"]
        elif last == "down_proj":
            candidates = [f"{stem}.down_proj.weight"]
        elif last == "e_score_correction_bias":  # the gguf package's key for it
            candidates = [f"{stem.replace('.moe_statics', '')}.e_score_correction.bias"]
        else:
            candidates = [hf_name]
        for name in candidates:
            gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
            assert gguf_name is not None, f"{arch} has no GGUF name for {name}"
            ours = model.locate_weight(gguf_to_hf_name(gguf_name))
            wanted = model.locate_weight(hf_name if name.endswith(".bias") else name)
            assert ours == wanted, (hf_name, gguf_name)
        checked.add(hf_name)
    assert checked == set(model.hf_weight_names())


def test_glm_skips_mtp_layers_and_names_missing_experts(tmp_path_factory):
    cfg = hf_config("tiny-glm4-moe", tmp_path_factory)
    hf = hf_model(cfg)
    ours = resolve_model_class(cfg)(cfg, torch.float32)
    state = dict(hf.state_dict())
    state["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)  # a multi-token-prediction layer
    ours.load_weights(state.items())
    partial = {k: v for k, v in state.items() if k != "model.layers.2.mlp.experts.down_proj"}
    with pytest.raises(ValueError, match=r"missing 1 weight.*layers\.2\.mlp\.experts\.down_proj"):
        ours.load_weights(partial.items())
    # per-expert names: one expert short of the stacked tensor is still missing
    per_expert = {k: v for k, v in partial.items()}
    for j in range(7):
        per_expert[f"model.layers.2.mlp.experts.{j}.down_proj.weight"] = torch.zeros(64, 32)
    with pytest.raises(ValueError, match=r"missing 1 weight.*layers\.2\.mlp\.experts\.down_proj"):
        ours.load_weights(per_expert.items())
    with pytest.raises(ValueError, match="unexpected checkpoint weight 'model.layers.0.mlp.gate"):
        ours.load_weights([("model.layers.0.mlp.gate.weight", torch.zeros(8, 64))], strict=False)


def test_ernie_moe_refuses_use_bias(tmp_path_factory):
    cfg = hf_config("tiny-ernie4.5-moe", tmp_path_factory, use_bias=True)
    with pytest.raises(ValueError, match="use_bias=True is not supported"):
        resolve_model_class(cfg)(cfg, torch.float32)


def test_profile_step_is_exactly_the_largest_step(tmp_path):
    """The memory profile runs a step of exactly ``max_num_batched_tokens`` tokens (the MoE
    workspace grows with the tokens), spread over ``max_num_seqs`` requests."""
    llm = LLM(
        write_preset("tiny-qwen3-moe", tmp_path),
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=256,
        max_num_seqs=3,
        max_num_batched_tokens=64,
    )
    sched = llm.engine.worker._profile_step()
    assert [s.num_new_tokens for s in sched.scheduled] == [22, 21, 21]


@pytest.mark.parametrize("arch", ["glm4moe", "ernie4_5", "ernie4_5-moe"])
def test_gguf_config_transformers_cannot_read_is_a_clear_error(arch, tmp_path):
    """Our tensor names cover these architectures, but ``transformers`` reads no config from
    their GGUF metadata, so resolving the file stops with a message naming the file."""
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"cannot read the model config of .*m\.gguf"):
        resolve_model(str(tmp_path / "m.gguf"))
