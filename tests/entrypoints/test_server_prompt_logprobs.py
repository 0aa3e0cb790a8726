"""The server with the default model: ``echo`` + ``logprobs`` on ``/v1/completions`` (OpenAI's
legacy scoring, as lm-eval's local-completions model uses it) and vLLM's ``prompt_logprobs`` on
both endpoints equal Hugging Face float32 (docs/accuracy.md: mean |Δ logprob| <= 1e-3); bad
requests get a 400 naming the field, and leave no KV block behind."""

from __future__ import annotations

import httpx
import pytest
import torch
from http_server_utils import serve_in_thread, wait_until
from support import default_model_hf_float32

from fastdeploy.engine.args_utils import EngineArgs

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
TEXT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"
MEAN_TOL = 1e-3


@pytest.fixture(scope="module")
def server():
    """(url, engine, tokenizer, HF float32 log-probabilities of a token list)."""
    from fastdeploy.engine.engine import LLMEngine

    _, hf = default_model_hf_float32()

    def hf_logprobs(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)

    args = EngineArgs(block_size=16, max_num_seqs=4, max_model_len=512, seed=0)
    engine = LLMEngine.from_engine_args(args)
    with serve_in_thread(engine, MODEL) as (url, _):
        yield url, engine, engine.tokenizer, hf_logprobs
    engine.shutdown()


def post(url: str, path: str, body: dict, status: int = 200) -> dict:
    r = httpx.post(url + path, json={"model": MODEL, "temperature": 0, **body}, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def deltas(got: list[float], ids: list[int], ref: torch.Tensor) -> torch.Tensor:
    """|Δ logprob| of prompt tokens 1.. (``got[i - 1]`` scores ``ids[i]``)."""
    want = torch.tensor([ref[i - 1, ids[i]].item() for i in range(1, len(ids))])
    return (torch.tensor(got) - want).abs()


def test_echo_logprobs_score_the_prompt_as_hf(server):
    url, _, tokenizer, hf_logprobs = server
    ids = tokenizer.encode(TEXT)
    body = post(url, "/v1/completions", {"prompt": TEXT, "echo": True, "logprobs": 2,
                                         "max_tokens": 0})  # fmt: skip
    choice = body["choices"][0]
    assert choice["text"] == TEXT and choice["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) == len(lp["token_logprobs"]) == len(lp["text_offset"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert "".join(lp["tokens"]).replace("Ġ", " ") == TEXT  # byte-level tokens of the text
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert TEXT[lp["text_offset"][-1] :] == " is"
    d = deltas(lp["token_logprobs"][1:], ids, hf_logprobs(ids))
    print(f"\necho + logprobs vs HF float32: mean {d.mean():.2e}, max {d.max():.2e}")
    assert d.mean() <= MEAN_TOL and d.max() <= 1e-2
    assert all(1 <= len(t) <= 3 for t in lp["top_logprobs"][1:])  # top 2 + the prompt token


def test_echo_with_token_ids_and_generated_tokens(server):
    url, _, tokenizer, hf_logprobs = server
    ids = tokenizer.encode(TEXT)
    body = post(url, "/v1/completions", {"prompt": ids, "echo": True, "logprobs": 1,
                                         "max_tokens": 3})  # fmt: skip
    choice = body["choices"][0]
    prompt_text = tokenizer.decode(ids)
    assert choice["text"].startswith(prompt_text) and len(choice["text"]) > len(prompt_text)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3 and body["usage"]["completion_tokens"] == 3
    assert lp["text_offset"][len(ids)] == len(prompt_text)  # the completion starts after it
    generated = post(url, "/v1/completions", {"prompt": ids, "max_tokens": 3})["choices"][0]
    assert choice["text"] == prompt_text + generated["text"]  # greedy: the same completion
    d = deltas(lp["token_logprobs"][1 : len(ids)], ids, hf_logprobs(ids))
    assert d.mean() <= MEAN_TOL


def test_prompt_logprobs_on_both_endpoints_in_vllm_shape(server):
    url, _, tokenizer, hf_logprobs = server
    ids = tokenizer.encode(TEXT)
    ref = hf_logprobs(ids)
    body = post(url, "/v1/completions", {"prompt": TEXT, "prompt_logprobs": 3, "max_tokens": 1})
    plp = body["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    got = []
    for i in range(1, len(ids)):
        entry = plp[i]
        mine = entry[str(ids[i])]
        got.append(mine["logprob"])
        assert set(mine) == {"logprob", "rank", "decoded_token"}
        # The prompt token (first) and the top 3 (ranks 1..3), the token once when among them.
        assert list(entry)[0] == str(ids[i]) and len(entry) == (3 if mine["rank"] <= 3 else 4)
        by_rank = {v["rank"]: int(k) for k, v in entry.items()}
        assert {1, 2, 3} <= set(by_rank)
        best = ref[i - 1].topk(2)
        if best.values[0] - best.values[1] > 1e-3:
            assert by_rank[1] == best.indices[0].item()
    d = deltas(got, ids, ref)
    print(f"\nprompt_logprobs over HTTP vs HF float32: mean {d.mean():.2e}, max {d.max():.2e}")
    assert d.mean() <= MEAN_TOL
    assert body["choices"][0]["logprobs"] is None
    plain = post(url, "/v1/completions", {"prompt": TEXT, "max_tokens": 1})
    assert "prompt_logprobs" not in plain["choices"][0]  # only when asked

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = post(url, "/v1/chat/completions", {"messages": messages, "prompt_logprobs": 0,
                                              "max_tokens": 1})  # fmt: skip
    chat_ids = list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    )
    plp = chat["prompt_logprobs"]
    assert len(plp) == len(chat_ids) and plp[0] is None
    d = deltas([plp[i][str(chat_ids[i])]["logprob"] for i in range(1, len(chat_ids))],
               chat_ids, hf_logprobs(chat_ids))  # fmt: skip
    assert d.mean() <= MEAN_TOL


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": -1}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": "2"}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "echo": True, "stream": True}, "echo"),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True},
         "prompt_logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "prompt_logprobs": 99}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": [7, 10**9], "echo": True, "logprobs": 1}, "prompt"),
    ],
)  # fmt: skip
def test_bad_requests_are_400s_naming_the_field_and_leak_nothing(server, path, body, param):
    url, engine, _, _ = server
    error = post(url, path, body, status=400)["error"]
    assert error["param"] == param, error
    assert param in error["message"] or param == "prompt"

    def idle() -> bool:
        stats = engine.get_stats()
        return stats["num_running"] == stats["num_waiting"] == 0 and (
            stats["num_free_blocks"] == stats["num_total_blocks"]
        )

    wait_until(idle, 10, "the engine to hold no request and no block")
    assert post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 1})["choices"]
