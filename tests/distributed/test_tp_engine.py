"""Tensor parallelism behind the engine, on CPU over gloo (float32): a tiny Llama and a tiny
Qwen3 at TP=2 give TP=1's greedy tokens through ``LLM``; the loaders shard safetensors, GGUF and
dummy weights; a killed rank ends the engine with an error naming it within 10 s; SIGTERM to the
engine's process ends its ranks; every process a test starts is gone when it ends."""

from __future__ import annotations

import ast
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import httpx
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file
from test_tp_processes import free_port, run_two_ranks
from tp_targets import loader_rank, node_main

from fastdeploy import LLM, SamplingParams
from fastdeploy.distributed.launcher import RankDiedError
from fastdeploy.distributed.parallel_state import destroy_tp_group
from fastdeploy.model_executor.models.registry import resolve_model_class
from fastdeploy.worker.executor import TensorParallelWorker

COMMON = dict(
    vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    rms_norm_eps=1e-6,
)  # fmt: skip
ENGINE = dict(
    skip_tokenizer_init=True, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32,
    block_size=16, seed=0,
)  # fmt: skip
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [list(range(3, 8)), [(7 * i) % 240 + 5 for i in range(45)], list(range(100, 123))]


def hf_config(name: str):
    if name == "qwen3":
        cfg = transformers.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False)
        cfg.architectures = ["Qwen3ForCausalLM"]
    else:
        cfg = transformers.LlamaConfig(**COMMON, tie_word_embeddings=True, mlp_bias=True)
        cfg.architectures = ["LlamaForCausalLM"]
    return cfg


def random_model(cfg):
    """Our model of ``cfg`` with weights large enough that greedy choices are decisive (no
    near-ties at 1e-6)."""
    model = resolve_model_class(cfg)(cfg, torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if "norm" in name else 0.3 * noise)
    return model


def hf_weights(model) -> dict[str, torch.Tensor]:
    """Checkpoint tensors under Hugging Face names (a tied head left out, as HF saves it)."""
    state = model.hf_state_dict()
    if model.lm_head.tied:
        del state["lm_head.weight"]
    return {name: t.contiguous().clone() for name, t in state.items()}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """``name -> safetensors directory`` of a tiny random Llama (tied head, MLP bias) and Qwen3
    (q/k norm, untied head)."""
    dirs = {}
    for name in ("llama", "qwen3"):
        path = tmp_path_factory.mktemp(f"tiny-{name}")
        cfg = hf_config(name)
        cfg.save_pretrained(path)
        save_file(hf_weights(random_model(cfg)), str(path / "model.safetensors"))
        dirs[name] = str(path)
    return dirs


@pytest.fixture(scope="module")
def tp1_tokens(model_dirs):
    """``name -> (greedy tokens, seeded tokens)`` of the model at TP=1 (once per module)."""
    cache = {}

    def get(name: str) -> tuple[list[list[int]], list[int]]:
        if name not in cache:
            llm = start(model_dirs[name], 1)
            try:
                cache[name] = greedy_tokens(llm), seeded_tokens(llm)
            finally:
                stop(llm)
        return cache[name]

    return get


@pytest.fixture(autouse=True)
def end_every_process():
    """Whatever happens, end every process the test started and leave the group."""
    threads = torch.get_num_threads()
    yield
    for child in multiprocessing.active_children():
        child.kill()
        child.join(5)
    destroy_tp_group()
    torch.set_num_threads(threads)


def start(model: str, tp: int, **kw) -> LLM:
    return LLM(model, tensor_parallel_size=tp, **{**ENGINE, **kw})


def stop(llm: LLM) -> None:
    """Shut the worker down (ends the ranks), then the engine."""
    worker = llm.engine.worker
    if worker is not None:
        worker.shutdown()
    llm.engine.shutdown()


def greedy_tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def seeded_tokens(llm: LLM) -> list[int]:
    """A sampled request with a seed: rank 0 alone samples, from the gathered full logits."""
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=8, ignore_eos=True)
    return llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_tp2_gives_the_tokens_of_tp1(model_dirs, tp1_tokens, name):
    """Chunked prefill (45 tokens over a 32-token budget) and mixed steps included."""
    expected, expected_seeded = tp1_tokens(name)
    assert all(len(t) == 6 for t in expected) and len({tuple(t) for t in expected}) == 3
    llm = start(model_dirs[name], 2)
    worker = llm.engine.worker
    try:
        assert isinstance(worker, TensorParallelWorker)
        assert greedy_tokens(llm) == expected
        assert seeded_tokens(llm) == expected_seeded
        # Each rank holds half the KV heads of every block (2 -> 1).
        assert worker.num_kv_heads == 1
        assert worker.kv_caches[0].shape[3] == 1
        assert llm.engine.get_stats()["steps_by_mode"]["eager"] > 0
    finally:
        stop(llm)
    pids = worker.rank_pids.values()
    assert not any(_alive(pid) for pid in pids)
    assert multiprocessing.active_children() == []


@pytest.mark.slow
def test_a_killed_rank_ends_the_engine_naming_it_within_10_s(model_dirs):
    llm = start(model_dirs["llama"], 2)
    try:
        assert len(greedy_tokens(llm)[0]) == 6
        os.kill(llm.engine.worker.rank_pids[1], signal.SIGKILL)
        begin = time.monotonic()
        with pytest.raises(RankDiedError, match="tensor-parallel rank 1 was killed by signal 9"):
            greedy_tokens(llm)
        assert time.monotonic() - begin < 10
        with pytest.raises(RankDiedError, match="rank 1"):  # and it stays failed
            greedy_tokens(llm)
    finally:
        begin = time.monotonic()
        stop(llm)
        assert time.monotonic() - begin < 10


def test_kv_heads_that_do_not_divide_are_refused_before_any_rank_starts(model_dirs):
    with pytest.raises(
        ValueError, match="num_key_value_heads=2 does not divide by tensor_parallel_size=4"
    ):
        start(model_dirs["llama"], 4)
    assert multiprocessing.active_children() == []


# The server in a process of its own (run with ``-c``: a rank process started by ``spawn``
# re-imports a ``__main__`` file, not a ``-c`` string).
SERVER = textwrap.dedent(
    """
    import sys
    from fastdeploy.entrypoints.openai import api_server

    sys.exit(api_server.main(sys.argv[1:]))
    """
)


@pytest.mark.slow
def test_the_server_at_tp2_and_sigterm_ends_every_rank(model_dirs, tp1_tokens):
    """Greedy tokens through ``/v1/completions`` equal ``LLM`` at TP=1; SIGTERM to the server
    stops it (exit 0) and its rank process with it."""
    port = free_port()
    args = ["--model", model_dirs["qwen3"], "--port", str(port), "--device", "cpu",
            "--tensor-parallel-size", "2", "--skip-tokenizer-init", "--max-model-len", "256",
            "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--block-size", "16",
            "--log-level", "warning"]  # fmt: skip
    server = subprocess.Popen([sys.executable, "-c", SERVER, *args], cwd=os.getcwd())
    url = f"http://127.0.0.1:{port}"
    ranks = []
    try:
        _wait_healthy(url, server)
        ranks = [pid for pid in _children(server.pid) if "spawn_main" in _cmdline(pid)]
        assert len(ranks) == 1
        got = []
        for prompt in PROMPTS:
            body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                    "logprobs": 0}  # fmt: skip
            reply = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
            tokens = reply["choices"][0]["logprobs"][
                "tokens"
            ]  # "token_id:<id>" without a tokenizer
            got.append([int(t.rpartition(":")[2]) for t in tokens])
        assert got == tp1_tokens("qwen3")[0]
        server.send_signal(signal.SIGTERM)
        assert server.wait(20) == 0
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in ranks)
    finally:
        server.kill()
        server.wait()
        for pid in ranks:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _wait_healthy(url: str, server: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server.poll() is None, f"the server exited with {server.returncode}"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"the server was not healthy within {timeout_s} s")


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (from ``/proc``)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                found.append(int(entry))
    return found


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.slow
def test_two_nodes_on_one_host(model_dirs, tp1_tokens):
    """``--nnodes 2``: node 0 is the engine (rank 0 only), node 1 runs rank 1 in ``run_node``;
    the plan and the block count come from rank 0."""
    expected = tp1_tokens("qwen3")[0]
    addr = f"127.0.0.1:{free_port()}"
    multi = dict(ENGINE, tensor_parallel_size=2, nnodes=2, dist_init_addr=addr)
    node1 = multiprocessing.get_context("spawn").Process(
        target=node_main, args=(1, model_dirs["qwen3"], multi)
    )
    node1.start()
    try:
        llm = LLM(model_dirs["qwen3"], **multi)
        try:
            assert llm.engine.worker.rank_pids == {}  # no rank of its own on node 0
            assert greedy_tokens(llm) == expected
        finally:
            stop(llm)
        node1.join(15)
        assert node1.exitcode == 0
    finally:
        node1.kill()


@pytest.mark.slow
def test_second_node_through_the_cli(model_dirs, tp1_tokens):
    """``fastdeploy serve --node-rank 1`` runs node 1's rank (``run_node``), no server: it binds
    no port, follows node 0's engine and exits 0 when that engine shuts down."""
    expected = tp1_tokens("qwen3")[0]
    addr = f"127.0.0.1:{free_port()}"
    busy = socket.socket()  # a server would refuse this --port; node 1 never binds it
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    args = ["--model", model_dirs["qwen3"], "--device", "cpu", "--tensor-parallel-size", "2",
            "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", addr,
            "--skip-tokenizer-init", "--max-model-len", "256", "--max-num-seqs", "4",
            "--max-num-batched-tokens", "32", "--block-size", "16", "--seed", "0",
            "--host", "127.0.0.1", "--port", str(busy.getsockname()[1]),
            "--log-level", "warning"]  # fmt: skip
    node1 = subprocess.Popen(
        [sys.executable, "-m", "fastdeploy.entrypoints.openai.api_server", *args], cwd=os.getcwd()
    )
    try:
        multi = dict(ENGINE, tensor_parallel_size=2, nnodes=2, dist_init_addr=addr)
        llm = LLM(model_dirs["qwen3"], **multi)
        try:
            assert greedy_tokens(llm) == expected
        finally:
            stop(llm)
        assert node1.wait(30) == 0
    finally:
        busy.close()
        node1.kill()
        node1.wait()


@pytest.mark.slow
def test_loaders_shard_safetensors_gguf_and_dummy_weights(model_dirs, tmp_path):
    """Each rank's shard, loaded by ``get_model(..., tp=...)``, gives the whole model's logits
    and tokens: from safetensors, from a GGUF file (Q/K rows permuted by llama.cpp's converter)
    and from dummy weights (drawn at full size, so every TP size gets the same model)."""
    cfg = hf_config("llama")
    cfg.tie_word_embeddings, cfg.mlp_bias = False, False  # as GGUF metadata describes it
    write_llama_gguf(tmp_path / "tiny.gguf", hf_weights(random_model(cfg)), cfg)
    sources = {
        "safetensors": (model_dirs["qwen3"], "auto"),
        "gguf": (str(tmp_path / "tiny.gguf"), "auto"),
        "dummy": (model_dirs["llama"], "dummy"),
    }
    run_two_ranks(loader_rank, tmp_path, sources)
    for rank in range(2):
        results = ast.literal_eval((tmp_path / f"loader{rank}.txt").read_text())
        for name, r in results.items():
            assert r["diff"] < 1e-4, (rank, name, r["diff"])
            assert r["tp"] == r["full"], (rank, name)
            assert r["kv_heads"] == 1


def write_llama_gguf(path, weights: dict[str, torch.Tensor], cfg) -> None:
    """A float32 llama GGUF of ``weights`` (Hugging Face names), with Q/K rows permuted as
    llama.cpp's ``convert_hf_to_gguf.py`` does."""
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    for hf_name, tensor in weights.items():
        if hf_name.endswith("self_attn.q_proj.weight"):
            tensor = _permute(tensor, cfg.num_attention_heads)
        elif hf_name.endswith("self_attn.k_proj.weight"):
            tensor = _permute(tensor, cfg.num_key_value_heads)
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, hf_name
        writer.add_tensor(gguf_name, tensor.contiguous().numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's ``LlamaModel.permute``."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of ours still answers kill(0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
