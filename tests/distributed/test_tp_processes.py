"""Tensor-parallel plumbing on CPU over gloo: collectives and the step broadcast between real
rank processes, a dead rank named within seconds, every process ended afterwards."""

from __future__ import annotations

import ast
import socket
import time

import pytest
import torch.multiprocessing as mp
from tp_targets import collective_rank, die_rank, layers_rank, model_rank, stubborn_rank

from fastdeploy.distributed.launcher import RankDiedError, RankProcesses
from fastdeploy.distributed.parallel_state import parse_dist_init_addr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_ranks(target, tmp_path, *extra, timeout_s: float = 180) -> None:
    """Run ``target(rank, 2, addr, tmp_path, *extra)`` in two spawned ranks; both must exit 0.
    Every process is killed afterwards, even when an assertion fails."""
    addr = f"127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, 2, addr, str(tmp_path), *extra)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout_s)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


@pytest.mark.slow
def test_collectives_and_step_broadcast_between_two_ranks(tmp_path):
    run_two_ranks(collective_rank, tmp_path)
    for rank in range(2):
        text = (tmp_path / f"rank{rank}.txt").read_text()
        summed, gathered, step, big_ok, empty = ast.literal_eval(text)
        assert summed == [3.0, 3.0, 3.0]  # 1 + 2
        assert gathered == [0.0, 1.0]  # rank order
        assert step == {"step": 7, "from": 0}  # rank 0's object on every rank
        assert big_ok  # a message longer than the header buffer arrives whole
        assert empty is None


@pytest.mark.slow
def test_a_dead_rank_is_named_within_seconds_and_stop_ends_all():
    ranks = RankProcesses(die_rank, [1], args=(3,)).start()
    stubborn = RankProcesses(stubborn_rank, [2]).start()
    try:
        start = time.monotonic()
        with pytest.raises(RankDiedError, match="tensor-parallel rank 1 exited with code 3"):
            ranks.check(timeout_s=10)
        assert time.monotonic() - start < 10
        stubborn.check(timeout_s=0.2)  # alive: no error
    finally:
        ranks.stop()
        stubborn.stop(grace_s=1)
    assert not any(p.is_alive() for p in stubborn.processes.values())
    assert stubborn.processes[2].exitcode == -9  # SIGTERM ignored, SIGKILL after the grace


@pytest.mark.parametrize("bad", ["127.0.0.1", "host:99999", ":80", 5])
def test_bad_dist_init_addr(bad):
    with pytest.raises(ValueError, match="dist_init_addr=.* is invalid; allowed: host:port"):
        parse_dist_init_addr(bad)


@pytest.mark.slow
def test_parallel_layers_equal_their_unsharded_twins(tmp_path):
    run_two_ranks(layers_rank, tmp_path)
    for rank in range(2):
        diffs = ast.literal_eval((tmp_path / f"layers{rank}.txt").read_text())
        for name in ("mlp", "qkv", "embedding", "lm_head"):
            assert diffs[name] < 1e-4, (rank, name, diffs[name])
        assert diffs["lm_head_shape"] == [5, 37]  # padding dropped after the gather
        assert diffs["error"] == (
            "num_key_value_heads=3 does not divide by tensor_parallel_size=2; allowed: a "
            "tensor_parallel_size that divides 3"
        )


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_tiny_model_at_tp2_equals_tp1(tmp_path, name):
    """Float32 on CPU over gloo: the sharded model, loaded from the full model's checkpoint
    tensors, gives its logits and its greedy tokens on both ranks."""
    run_two_ranks(model_rank, tmp_path, name)
    for rank in range(2):
        result = ast.literal_eval((tmp_path / f"model{rank}.txt").read_text())
        assert result["heads"] == (2, 1)  # 4 query and 2 KV heads over 2 ranks
        assert result["diff"] < 1e-4, result["diff"]
        assert result["tp"] == result["full"] and len(result["tp"]) == 8
