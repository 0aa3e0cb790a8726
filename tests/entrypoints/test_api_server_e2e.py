"""End to end: ``fastdeploy serve`` with the default model in a subprocess, the official ``openai``
client and plain HTTP against it (CPU). One module-scoped server, so the model loads once; the
last test stops it with SIGTERM. Every wait is bounded; only 127.0.0.1 is used.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from http_server_utils import free_port, get_json, process_group_pids, wait_until
from prometheus_client.parser import text_string_to_metric_families

from fastdeploy.config import FDConfig

# The official client is a test extra; a GPU-only host without it still collects this module.
openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "fastdeploy.entrypoints.cli.main", "serve"]
MODULE = [sys.executable, "-m", "fastdeploy.entrypoints.openai.api_server"]
MAX_MODEL_LEN = 1024
MAX_CONCURRENCY = 8
STARTUP_TIMEOUT_S = 300
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


class Server:
    """A server subprocess in its own session (process group), logging to a file."""

    def __init__(self, tmp_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / "server.log"
        args = [
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-num-seqs",
            "8",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--max-concurrency",
            str(MAX_CONCURRENCY),
            "--timeout-graceful-shutdown",
            "3",
        ]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                CLI + args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()}")
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def group_alive(self) -> list[int]:
        """Pids still in the server's process group (its children included)."""
        return process_group_pids(self.proc.pid)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("server"))
    try:
        wait_until(srv.healthy, STARTUP_TIMEOUT_S, "the server's /health")
        yield srv
    finally:
        srv.kill()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer():
    from fastdeploy.model_executor.model_loader.source import resolve_model

    return resolve_model(None, "auto", None).load_tokenizer()


def chat(client, messages, **kw):
    return client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, temperature=0, **kw
    )


def wait_idle(url: str) -> dict:
    """Wait until no request is in flight and every KV block is free; returns the stats."""
    state = {}

    def idle() -> bool:
        info = get_json(url, "/v1/server_info")
        state.update(info["stats"])
        return (
            info["num_in_flight"] == 0
            and state["num_running"] == 0
            and state["num_waiting"] == 0
            and state["kv_cache_usage"] == 0
        )

    wait_until(idle, 30, "an idle engine with all KV blocks free")
    return state


def test_chat_answers_paris(client):
    resp = chat(client, FRANCE, max_tokens=32)
    assert "Paris" in resp.choices[0].message.content


def test_tokenize_counts_the_chat_prompt_and_detokenize_round_trips(server, client, tokenizer):
    """``/tokenize`` of a conversation is the prompt the chat endpoint counts; ``/detokenize``
    gives back the text ``/tokenize`` took, the chat template's text for a conversation."""
    messages = FRANCE + [
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "Sure? ½ 東京"},
    ]
    r = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=30)
    assert r.status_code == 200, r.text
    tokens = r.json()
    assert tokens["count"] == chat(client, messages, max_tokens=1).usage.prompt_tokens
    assert (
        tokens["count"] == len(tokens["tokens"]) > 20 and tokens["max_model_len"] == MAX_MODEL_LEN
    )
    back = httpx.post(server.url + "/detokenize", json={"tokens": tokens["tokens"]}, timeout=30)
    want = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert back.json() == {"prompt": want}
    text = "Tokenize me: naïve café, 42 émojis 🙂 and\ttabs."
    r = httpx.post(
        server.url + "/tokenize", json={"prompt": text, "return_token_strs": True}, timeout=30
    )
    ids = r.json()["tokens"]
    assert ids == tokenizer.encode(text) and len(r.json()["token_strs"]) == len(ids)
    back = httpx.post(server.url + "/detokenize", json={"tokens": ids}, timeout=30)
    assert back.json() == {"prompt": text}
    vocab = len(tokenizer)
    r = httpx.post(server.url + "/detokenize", json={"tokens": [1, vocab]}, timeout=30)
    assert r.status_code == 400
    assert (
        f"tokens[1]={vocab} is outside the vocabulary; allowed: token ids in 0..{vocab - 1}"
        in r.text
    )


def test_stream_equals_non_stream_and_usage_matches_tokenizer(client, tokenizer):
    extra = {"ignore_eos": True}
    full = chat(client, FRANCE, max_tokens=12, extra_body=extra)
    chunks = list(
        chat(
            client,
            FRANCE,
            max_tokens=12,
            extra_body=extra,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    template = tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=False)
    n_prompt = len(tokenizer.encode(template, add_special_tokens=False))
    for usage in (full.usage, chunks[-1].usage):
        assert usage.prompt_tokens == n_prompt
        assert usage.completion_tokens == 12 and usage.total_tokens == n_prompt + 12
    with_lp = chat(client, FRANCE, max_tokens=12, extra_body=extra, logprobs=True)
    assert len(with_lp.choices[0].logprobs.content) == with_lp.usage.completion_tokens
    comp = client.completions.create(
        model=full.model, prompt="The capital of France is", max_tokens=5, temperature=0
    )
    assert comp.usage.prompt_tokens == len(tokenizer.encode("The capital of France is"))
    assert comp.usage.completion_tokens <= 5


EMOJI = "Emoji list: 😀😃😄😁😆😅😂🤣"


def test_completion_logprobs_keep_all_alternatives_of_partial_utf8_tokens(server):
    """The issue's example: 20 alternatives at every position, though most are pieces of
    emoji that a one-token decode turns into the same "\ufffd"."""
    body = {"prompt": EMOJI, "max_tokens": 6, "logprobs": 20, "temperature": 0}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == 6
    assert [len(top) for top in lp["top_logprobs"]] == [20] * 6  # greedy: chosen is among them
    assert all(tok in top for tok, top in zip(lp["tokens"], lp["top_logprobs"]))
    assert any(t.startswith("bytes:\\x") for t in lp["tokens"])  # a piece of an emoji
    text = choice["text"]
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][-1] < len(text)


def test_chat_logprobs_bytes_are_exact_and_alternatives_distinct(client):
    resp = chat(
        client, [{"role": "user", "content": EMOJI}], max_tokens=8, logprobs=True, top_logprobs=20
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == 8
    for entry in content:
        assert len(entry.top_logprobs) == 20
        assert len({bytes(t.bytes) for t in entry.top_logprobs}) == 20
    text = bytes(b for entry in content for b in entry.bytes).decode("utf-8", errors="replace")
    assert text.startswith(resp.choices[0].message.content)


def test_startup_log_names_the_cpu_kv_cache_space(server):
    log = server.log_path.read_text(errors="replace")
    assert "set by FD_CPU_KV_CACHE_SPACE=1 GiB" in log, log[:3000]


def test_eight_concurrent_requests_are_independent(client):
    prompts = [[{"role": "user", "content": f"Count from {i} to {i + 5}."}] for i in range(8)]
    alone = [chat(client, p, max_tokens=16).choices[0].message.content for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda p: chat(client, p, max_tokens=16), prompts))
    assert [r.choices[0].message.content for r in together] == alone
    assert len(set(alone)) > 1


def test_disconnect_mid_stream_frees_blocks(server):
    body = {"messages": FRANCE, "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        data = [line for _, line in zip(range(8), lines, strict=False) if line.startswith("data")]
        assert len(data) >= 3  # role chunk plus generated text: the request is running
    stats = wait_idle(server.url)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_queue_full_then_bad_inputs_then_still_serving(server, client):
    url = server.url
    body = {"messages": FRANCE, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with ExitStack() as stack, httpx.Client(timeout=60) as http:
        iters = []
        for _ in range(MAX_CONCURRENCY):
            resp = stack.enter_context(http.stream("POST", url + "/v1/chat/completions", json=body))
            iters.append(resp.iter_lines())
            next(iters[-1])  # the role chunk: the request is admitted
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert "max-concurrency" in r.json()["error"]["message"]
    wait_idle(url)
    cases = [
        (b'{"messages": [{"role": "user", "content": ', 400, ["malformed JSON"]),
        ({"messages": FRANCE, "temperature": "cold"}, 400, ["temperature"]),
        ({"messages": FRANCE, "max_tokens": 1.5}, 400, ["max_tokens"]),
        ({"messages": FRANCE, "bogus_field": True}, 400, ["bogus_field"]),
        (
            {"messages": [{"role": "user", "content": "hello " * 1100}]},
            400,
            ["max_model_len", str(MAX_MODEL_LEN)],
        ),
        ({"messages": FRANCE, "model": "no-such-model"}, 404, ["no-such-model"]),
    ]
    for payload, status, words in cases:
        kw = (
            {"content": payload, "headers": {"content-type": "application/json"}}
            if isinstance(payload, bytes)
            else {"json": payload}
        )
        r = httpx.post(url + "/v1/chat/completions", timeout=30, **kw)
        assert r.status_code == status, r.text
        message = r.json()["error"]["message"]
        assert all(w in message for w in words), message
    too_long = r"hello " * 1100
    r = httpx.post(
        url + "/v1/chat/completions",
        timeout=30,
        json={"messages": [{"role": "user", "content": too_long}]},
    )
    prompt_len = int(r.json()["error"]["message"].split("prompt has ")[1].split()[0])
    assert prompt_len > MAX_MODEL_LEN
    assert "Paris" in chat(client, FRANCE, max_tokens=32).choices[0].message.content


def test_metrics_parse_and_counters_move(server, client):
    def samples() -> dict:
        text = httpx.get(server.url + "/metrics", timeout=10).text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }

    before = samples()
    chat(client, FRANCE, max_tokens=6, extra_body={"ignore_eos": True})
    after = samples()

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert delta("fastdeploy:request_success_total", finished_reason="length") == 1
    assert delta("fastdeploy:generation_tokens_total") == 6
    assert delta("fastdeploy:prompt_tokens_total") > 0
    assert delta("fastdeploy:time_to_first_token_seconds_count") == 1
    assert delta("fastdeploy:e2e_request_latency_seconds_count") == 1
    assert delta("fastdeploy:time_per_output_token_seconds_count") == 5
    assert delta("fastdeploy:steps_total", mode="eager") >= 6  # CPU: graphs are off
    assert after[("fastdeploy:request_success_total", (("finished_reason", "abort"),))] >= 1
    assert after[("fastdeploy:request_rejected_total", (("reason", "queue_full"),))] >= 1
    assert after[("fastdeploy:num_requests_running", ())] == 0


@pytest.mark.parametrize("command", [CLI, MODULE], ids=["fastdeploy-serve", "api_server"])
def test_print_config_round_trips(command):
    out = subprocess.run(
        command + ["--print-config", "--device", "cuda", "--max-num-seqs", "8"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    config = FDConfig.from_dict(data["config"])
    assert config.to_dict() == data["config"]
    assert config.scheduler_config.max_num_seqs == 8 and "reasons" in data["deployment_plan"]


def test_bad_argument_exits_2_naming_it():
    out = subprocess.run(
        CLI + ["--print-config", "--max-num-seqs", "0"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and "max_num_seqs" in out.stderr


def test_sigterm_stops_cleanly_with_a_request_in_flight(server):
    body = {"messages": FRANCE, "max_tokens": 900, "ignore_eos": True, "stream": True}

    def stream_until_end() -> str:
        try:
            with httpx.stream(
                "POST", server.url + "/v1/chat/completions", json=body, timeout=60
            ) as r:
                return "".join(r.iter_lines())
        except httpx.HTTPError as e:
            return f"transport error: {e!r}"

    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(stream_until_end)
        wait_until(
            lambda: get_json(server.url, "/v1/server_info")["num_in_flight"] == 1,
            30,
            "the streaming request to be admitted",
        )
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0, server.log()
        streamed = pending.result(timeout=30)
    # The request outlived the 3 s grace period: it ends with an error event, then [DONE].
    assert "the server is shutting down" in streamed and streamed.endswith("data: [DONE]")
    assert time.monotonic() - started < 30
    wait_until(lambda: not server.group_alive(), 10, "no process left in the server's group")
    log = server.log()
    assert "engine loop stopped" in log and "stopped by SIGTERM" in log
    assert "Traceback" not in log, log
