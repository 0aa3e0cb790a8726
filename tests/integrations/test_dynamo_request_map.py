"""The Dynamo worker's request and output mapping (``fastdeploy.integrations.dynamo``), without
Dynamo: its token-in request to our ``SamplingParams``, our outputs to its chunks, the model card
config, and the worker's command line."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastdeploy.entrypoints.engine_client.output_processor import CompletionOutput, RequestOutput
from fastdeploy.integrations.dynamo.args import make_worker_parser, parse_endpoint
from fastdeploy.integrations.dynamo.model_card import card_config
from fastdeploy.integrations.dynamo.request_map import error_chunk, to_chunk, to_sampling_params


def test_sampling_options_and_stop_conditions_map_to_ours():
    prompt, params = to_sampling_params(
        {
            "token_ids": [1, 2, 3],
            "sampling_options": {
                "temperature": 0.0,
                "top_p": 0.9,
                "top_k": 5,
                "seed": 7,
                "presence_penalty": 0.5,
                "frequency_penalty": 0.25,
                "repetition_penalty": 1.1,
                "n": 1,
                "min_p": None,
            },
            "stop_conditions": {
                "max_tokens": 12,
                "min_tokens": 2,
                "ignore_eos": True,
                "stop": ["END"],
                "stop_token_ids_hidden": [9, 4, 9],
            },
            "output_options": {"logprobs": 3, "skip_special_tokens": False},
        },
        max_model_len=64,
    )
    assert prompt == [1, 2, 3]
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.0, 0.9, 5, 7)
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, 0.25)
    assert params.repetition_penalty == 1.1
    assert (params.max_tokens, params.min_tokens, params.ignore_eos) == (12, 2, True)
    assert params.stop == ["END"] and params.stop_token_ids == [4, 9]
    assert params.logprobs == 3 and params.skip_special_tokens is False


def test_without_max_tokens_a_request_may_fill_the_context():
    _, params = to_sampling_params({"token_ids": [5] * 10}, max_model_len=64)
    assert params.max_tokens == 54


@pytest.mark.parametrize(
    "request_, message",
    [
        ({"token_ids": []}, r"token_ids=\[\] is invalid"),
        ({"token_ids": [1], "sampling_options": {"n": 2}}, "n=2 is not supported"),
        ({"token_ids": [1], "sampling_options": {"use_beam_search": True}}, "use_beam_search"),
        ({"token_ids": [1], "sampling_options": {"min_p": 0.1}}, "min_p=0.1"),
        (
            {"token_ids": [1], "sampling_options": {"guided_decoding": {"json": {}}}},
            "guided_decoding",
        ),
        ({"token_ids": [1], "output_options": {"prompt_logprobs": 1}}, "prompt_logprobs=1"),
        ({"token_ids": [1], "sampling_options": {"temperature": -1.0}}, "temperature"),
    ],
)
def test_a_request_we_cannot_honour_is_refused_by_name(request_, message):
    with pytest.raises(ValueError, match=message):
        to_sampling_params(request_, max_model_len=64)


def _output(delta, finished=False, reason=None, cached=0, logprobs=None):
    seq = CompletionOutput(0, "", [7, 8, *delta], None, reason, None, "", delta, logprobs)
    return RequestOutput("r", None, [1, 2, 3], [seq], finished, cached)


def test_chunks_carry_new_tokens_then_finish_reason_and_usage():
    assert to_chunk(_output([8])) == {"token_ids": [8], "index": 0}
    last = to_chunk(_output([9], finished=True, reason="length", cached=2))
    assert last["token_ids"] == [9] and last["finish_reason"] == "length"
    assert last["completion_usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    assert to_chunk(_output([], finished=True, reason="abort"))["finish_reason"] == "cancelled"
    assert to_chunk(_output([], finished=True, reason="stop"))["finish_reason"] == "stop"
    assert error_chunk("boom") == {"token_ids": [], "index": 0, "finish_reason": "error: boom"}


def test_chunk_logprobs_in_dynamo_shape():
    lp = [{"token_id": 9, "logprob": -0.5, "top_logprobs": [(9, -0.5), (4, -1.5)]}]
    chunk = to_chunk(_output([9], logprobs=lp))
    assert chunk["log_probs"] == [-0.5]
    assert chunk["top_logprobs"] == [
        [
            {"rank": 1, "token_id": 9, "token": None, "logprob": -0.5},
            {"rank": 2, "token_id": 4, "token": None, "logprob": -1.5},
        ]
    ]


def test_card_config_names_the_causal_lm_class():
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2)
    assert card_config(config)["architectures"] == ["LlamaForCausalLM"]
    config.architectures = ["MyLlama"]
    assert card_config(config)["architectures"] == ["MyLlama"]


def test_worker_command_line():
    args = make_worker_parser().parse_args(
        ["--endpoint", "dyn://ns.comp.gen", "--event-plane", "nats", "--no-dynamo-kv-events"]
    )
    assert parse_endpoint(args.endpoint) == ("ns", "comp", "gen")
    assert (args.discovery_backend, args.request_plane, args.event_plane) == ("etcd", "tcp", "nats")
    assert args.dynamo_kv_events is False
    assert make_worker_parser().parse_args([]).endpoint == "dyn://dynamo.backend.generate"
    with pytest.raises(ValueError, match="--endpoint='a.b' is invalid"):
        parse_endpoint("a.b")


def test_without_dynamo_the_worker_says_what_to_install(monkeypatch, capsys):
    import sys

    from fastdeploy.integrations.dynamo.launch import run_from_args

    monkeypatch.setitem(sys.modules, "dynamo", None)  # import dynamo -> ImportError
    monkeypatch.delitem(sys.modules, "fastdeploy.integrations.dynamo.engine", raising=False)
    assert run_from_args(make_worker_parser().parse_args([])) == 2
    assert "pip install --no-deps ai-dynamo==1.6.1" in capsys.readouterr().err


def test_model_card_of_the_default_gguf(tmp_path):
    import json

    from transformers import AutoTokenizer

    from fastdeploy.integrations.dynamo.model_card import REQUIRED_FILES, model_card_dir
    from fastdeploy.model_executor.model_loader.source import resolve_model

    source = resolve_model(None)  # the default SmolLM2-135M-Instruct GGUF
    card = model_card_dir(source, cache_dir=tmp_path)
    assert all((tmp_path / card / f).is_file() for f in REQUIRED_FILES)
    config = json.loads((tmp_path / card / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == source.hf_config.num_hidden_layers
    text = "Hello, Dynamo! <|im_start|>user"
    ours = source.load_tokenizer()
    assert AutoTokenizer.from_pretrained(card)(text).input_ids == ours(text).input_ids
    assert model_card_dir(source, cache_dir=tmp_path) == card  # written once, then reused
    assert [p.name for p in tmp_path.iterdir()] == [Path(card).name]  # no temporary left
