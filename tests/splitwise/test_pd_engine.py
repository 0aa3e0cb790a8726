"""PD disaggregation at the engine level, in one process: a prefill engine, a decode engine and a
mixed engine on a tiny random-weight Llama (float32), KV moved over the ``tcp`` transport through
the real side channel. Greedy output equals mixed; every block is accounted for afterwards,
after failures and aborts too."""

from __future__ import annotations

import json
import socket
import time

import pytest
import torch
from tiny_models import tiny_llama

from fastdeploy.core.errors import KVTransferError
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.engine.engine import LLMEngine

TINY = tiny_llama(num_hidden_layers=3)

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_llama_pd")
    (d / "config.json").write_text(json.dumps(TINY))
    return str(d)


def engine(tiny_dir, role="mixed", **kw) -> LLMEngine:
    args = dict(
        model=tiny_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=256,
        block_size=16,
        max_num_seqs=8,
        num_gpu_blocks_override=64,
        seed=0,
        device="cpu",
        splitwise_role=role,
        cache_transfer_protocol="tcp",
    )
    args.update(kw)
    return LLMEngine.from_engine_args(EngineArgs(**args))


@pytest.fixture(scope="module")
def mixed(tiny_dir):
    e = engine(tiny_dir)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def prefill(tiny_dir):
    e = engine(tiny_dir, "prefill", pd_lease_s=5.0)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def decode(tiny_dir):
    e = engine(tiny_dir, "decode")
    yield e
    e.shutdown()


def prompts(n=4, lo=3, hi=120, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, 512, (k,), generator=g).tolist() for k in lens]


def run(eng: LLMEngine, rid: str, prompt, params=GREEDY, kv=None, timeout_s=30.0):
    """Add one request and step until it finishes; returns its outputs."""
    eng.add_request(rid, prompt, params, kv)
    outs = []
    deadline = time.monotonic() + timeout_s
    while not (outs and outs[-1].finished):
        assert time.monotonic() < deadline, f"request {rid} did not finish"
        outs += [o for o in eng.step() if o.request_id == rid]
        if eng.last_step_idle:
            time.sleep(0.005)
    return outs


def settle(eng: LLMEngine, timeout_s=10.0):
    """Step until no background PD work is left (pending sends released, pulls ended)."""
    deadline = time.monotonic() + timeout_s
    while eng.has_background_work() or eng.has_unfinished_requests():
        assert time.monotonic() < deadline, f"PD work left: {eng.get_stats().get('pd')}"
        eng.step()
        time.sleep(0.005)


def tokens(outs):
    return [t for o in outs for t in o.new_token_ids]


def assert_all_free(eng: LLMEngine):
    eng.check_integrity()
    kv = eng.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks, "a block is still held"


def pd_generate(prefill, decode, rid, prompt, params=GREEDY):
    p_outs = run(prefill, f"p-{rid}", prompt, params, {"do_remote_decode": True})
    assert len(tokens(p_outs)) == 1
    kv = p_outs[-1].kv_transfer_params
    assert kv is not None and kv["first_token_id"] == tokens(p_outs)[0]
    d_outs = run(decode, f"d-{rid}", prompt, params, kv)
    # The first token goes out alone, as soon as the KV landed (one output per step).
    assert d_outs[0].new_token_ids == [kv["first_token_id"]]
    return p_outs, d_outs


def test_pd_greedy_equals_mixed_and_frees_everything(mixed, prefill, decode):
    for i, prompt in enumerate(prompts()):
        want = tokens(run(mixed, f"m{i}", prompt))
        p_outs, d_outs = pd_generate(prefill, decode, i, prompt)
        assert tokens(d_outs) == want, f"prompt of {len(prompt)} tokens"
        assert d_outs[-1].finish_reason == "length"
        assert d_outs[0].num_prompt_tokens == len(prompt)
    settle(prefill)
    settle(decode)
    stats = prefill.get_stats()["pd"]
    assert stats["pending_sends"] == 0 and stats["pending_send_blocks"] == 0
    assert stats["done_total"] == 4 and stats["claims_total"] >= 1
    d_stats = decode.get_stats()["pd"]
    assert d_stats["transfers"] >= 1 and d_stats["transfer_bytes"] > 0
    for eng in (prefill, decode, mixed):
        assert_all_free(eng)


def test_decode_node_prefix_hit_pulls_only_missing_blocks(prefill, decode):
    prompt = prompts(1, 70, 71, seed=3)[0]
    _, first = pd_generate(prefill, decode, "hit1", prompt)
    before = decode.get_stats()["pd"]["transfer_bytes"]
    _, second = pd_generate(prefill, decode, "hit2", prompt)
    pulled = decode.get_stats()["pd"]["transfer_bytes"] - before
    assert tokens(first) == tokens(second)
    # 70 tokens = 5 blocks of 16; the 4 full ones are cached on the decode node.
    per_block = 2 * 16 * 2 * 16 * 4 * 3  # K and V, block, kv heads, head dim, fp32, layers
    assert pulled == per_block, (pulled, per_block)
    settle(prefill)
    settle(decode)
    assert_all_free(prefill)
    decode.check_integrity()


def test_layout_mismatch_is_refused(prefill, decode):
    prompt = prompts(1, 20, 21, seed=4)[0]
    p_outs = run(prefill, "p-layout", prompt, GREEDY, {"do_remote_decode": True})
    kv = dict(p_outs[-1].kv_transfer_params)
    kv["layout"] = {**kv["layout"], "block_size": 32}
    before = dict(prefill.get_stats()["pd"])
    with pytest.raises(ValueError, match="block_size: prefill 32 != decode 16"):
        decode.add_request("d-layout", prompt, GREEDY, kv)
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        decode.add_request("d-len", prompt[:-1], GREEDY, p_outs[-1].kv_transfer_params)
    with pytest.raises(ValueError, match="do_remote_decode=true is invalid on a decode node"):
        decode.add_request("d-leg", prompt, GREEDY, {"do_remote_decode": True})
    settle(prefill, timeout_s=3)  # the refused leg's ABORT frees it, before the 5 s lease
    after = prefill.get_stats()["pd"]
    assert after["aborts_total"] == before["aborts_total"] + 1
    assert after["expired_total"] == before["expired_total"]
    assert after["pending_sends"] == 0
    assert_all_free(prefill)


def test_a_reference_to_another_prompt_of_the_same_length_is_refused(prefill, decode):
    """A prefill answer for prompt A sent with prompt B of the same length: refused before a
    block is read or cached, naming prompt_hash, and the prefill node frees A's blocks now (not
    at lease expiry). Then A's own leg still works."""
    a, b = prompts(2, 50, 51, seed=9)
    assert len(a) == len(b) and a != b
    p_outs = run(prefill, "p-other", a, GREEDY, {"do_remote_decode": True})
    kv = p_outs[-1].kv_transfer_params
    with pytest.raises(ValueError, match="prompt_hash=.* belongs to another prompt"):
        decode.add_request("d-other", b, GREEDY, kv)
    assert decode.scheduler.get_request("d-other") is None
    t0 = time.monotonic()
    settle(prefill)  # the ABORT of the refused leg arrives at once
    assert time.monotonic() - t0 < 3  # the lease is 5 s
    stats = prefill.get_stats()["pd"]
    assert stats["aborts_total"] >= 1 and stats["pending_sends"] == 0
    assert_all_free(prefill)
    missing = {k: v for k, v in kv.items() if k != "prompt_hash"}
    with pytest.raises(ValueError, match="missing or mistypes prompt_hash"):
        decode.add_request("d-nohash", a, GREEDY, missing)


def dead_peer_params(prefill, prompt):
    """A prefill answer whose node is gone: its blocks were already released."""
    p_outs = run(prefill, f"p-dead-{len(prompt)}", prompt, GREEDY, {"do_remote_decode": True})
    kv = p_outs[-1].kv_transfer_params
    from fastdeploy.splitwise.side_channel import send_control

    send_control(kv["remote_host"], kv["remote_port"], "ABORT", [kv["remote_request_id"]])
    settle(prefill)
    return kv


def test_failed_transfer_fails_or_recomputes(tiny_dir, mixed, prefill, decode):
    prompt = prompts(1, 40, 41, seed=5)[0]
    kv = dead_peer_params(prefill, prompt)
    outs = run(decode, "d-fail", prompt, GREEDY, kv)
    assert len(outs) == 1 and isinstance(outs[0].error, KVTransferError)
    assert "claim" in str(outs[0].error)
    settle(decode)
    decode.check_integrity()
    assert decode.get_stats()["pd"]["failures"].get("claim", 0) >= 1

    recompute = engine(tiny_dir, "decode", kv_load_failure_policy="recompute")
    try:
        outs = run(recompute, "d-recompute", prompt, GREEDY, kv)
        assert tokens(outs) == tokens(run(mixed, "m-recompute", prompt))
        settle(recompute)
        assert_all_free(recompute)
    finally:
        recompute.shutdown()


def test_abort_while_waiting_for_kv_frees_both_sides(prefill, decode):
    prompt = prompts(1, 100, 101, seed=6)[0]
    p_outs = run(prefill, "p-abort", prompt, GREEDY, {"do_remote_decode": True})
    decode.add_request("d-abort", prompt, GREEDY, p_outs[-1].kv_transfer_params)
    decode.step()  # admitted: blocks allocated, pull started
    decode.abort_request("d-abort")
    settle(decode)
    settle(prefill)
    decode.check_integrity()
    assert prefill.get_stats()["pd"]["pending_sends"] == 0
    assert_all_free(prefill)


def test_min_tokens_on_either_leg_gives_mixed_output(mixed, prefill, decode):
    """A router may send min_tokens=1 on the prefill leg (vllm-router does): the prefill node
    still samples the unconstrained first token, and the decode node applies the client's
    min_tokens (recomputing the last prompt token when that masks the carried token)."""
    prompt = prompts(1, 30, 31, seed=7)[0]
    first = tokens(run(mixed, "m-first", prompt))[0]
    for i, min_tokens in enumerate((0, 2)):
        client = SamplingParams(
            temperature=0.0, max_tokens=6, stop_token_ids=[first], min_tokens=min_tokens
        )
        want = run(mixed, f"m-min{i}", prompt, client)
        router_leg = SamplingParams(temperature=0.0, max_tokens=1, min_tokens=1)
        p_outs = run(prefill, f"p-min{i}", prompt, router_leg, {"do_remote_decode": True})
        assert p_outs[-1].kv_transfer_params["first_token_id"] == first
        got = run(decode, f"d-min{i}", prompt, client, p_outs[-1].kv_transfer_params)
        assert tokens(got) == tokens(want)
        assert got[-1].finish_reason == want[-1].finish_reason
    assert tokens(want)[0] != first  # min_tokens=2 masked it on both
    settle(prefill)
    settle(decode)
    assert_all_free(prefill)
    decode.check_integrity()


def test_forged_decode_legs_fail_that_request_only(mixed, prefill, decode):
    """A client-edited decode leg never kills the engine nor reads other blocks: a token id
    outside the vocabulary or malformed logprobs are refused; block ids other than those the
    prefill node holds fail the pull (nothing cached); transport metadata pointing elsewhere is
    ignored: the decode node reads from where the prefill node's CLAIM answer says."""
    prompt = prompts(1, 40, 41, seed=8)[0]
    p_outs = run(prefill, "p-forge", prompt, GREEDY, {"do_remote_decode": True})
    kv = p_outs[-1].kv_transfer_params
    for bad in (-1, 512, 10**9):
        with pytest.raises(ValueError, match="first_token_id"):
            decode.add_request("d-tok", prompt, GREEDY, kv | {"first_token_id": bad})
    with pytest.raises(ValueError, match="first_token_logprobs"):
        decode.add_request("d-lp", prompt, GREEDY, kv | {"first_token_logprobs": [1, 2, 3]})
    settle(prefill)  # each refusal sent ABORT: the blocks are free again
    assert_all_free(prefill)
    p_outs = run(prefill, "p-forge1", prompt, GREEDY, {"do_remote_decode": True})
    kv = p_outs[-1].kv_transfer_params
    forged = kv | {"remote_block_ids": [b + 1 for b in kv["remote_block_ids"]]}
    outs = run(decode, "d-forged", prompt, GREEDY, forged)
    assert isinstance(outs[-1].error, KVTransferError) and "other blocks" in str(outs[-1].error)
    trap = socket.create_server(("127.0.0.1", 0))
    trap.settimeout(0.5)
    redirects = ({"transport": "nixl"}, {"transport": "tcp", "host": "127.0.0.1", "port": 0})
    try:
        redirects[1]["port"] = trap.getsockname()[1]
        for i, (meta, fresh) in enumerate(zip(redirects, prompts(2, 40, 41, seed=9))):
            p2 = run(prefill, f"p-redirect{i}", fresh, GREEDY, {"do_remote_decode": True})
            before = decode.pd.counts["transfer_bytes"]
            kv2 = p2[-1].kv_transfer_params | {"transport": meta}
            outs = run(decode, f"d-redirect{i}", fresh, GREEDY, kv2)
            assert outs[-1].error is None
            assert decode.pd.counts["transfer_bytes"] > before  # pulled, from the prefill node
        with pytest.raises(TimeoutError):
            trap.accept()  # nobody connected to the address the client wrote in
    finally:
        trap.close()
    settle(prefill)
    settle(decode)
    assert_all_free(prefill)  # the failed pulls sent ABORT: nothing waits for the lease
    decode.check_integrity()
    # Nothing forged entered the decode node's prefix cache: the real leg still equals mixed.
    _, d_outs = pd_generate(prefill, decode, "forge-ok", prompt)
    assert tokens(d_outs) == tokens(run(mixed, "m-forge", prompt))
