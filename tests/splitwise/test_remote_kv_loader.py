"""Decode-side pulls against a real prefill-side control channel and tcp transports (CPU): the
blocks land, the prefill node frees exactly once, and every failure path says why."""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from support import ManualClock

from fastdeploy.splitwise.prefill_control import PrefillControl
from fastdeploy.splitwise.protocol import RemotePrefill, kv_layout, prompt_fingerprint
from fastdeploy.splitwise.remote_kv_loader import PullJob, RemoteKVLoader
from fastdeploy.splitwise.side_channel import SideChannelServer
from fastdeploy.splitwise.tcp_transport import TcpKVTransport

SHAPE = (10, 2, 4, 2, 8)


@pytest.fixture
def pair():
    g = torch.Generator().manual_seed(0)
    src = [torch.randn(SHAPE, generator=g) for _ in range(2)]
    dst = [torch.zeros(SHAPE) for _ in range(2)]
    clock = ManualClock()
    control = PrefillControl(lease_s=30, transfer_s=10, clock=clock)
    side = SideChannelServer("127.0.0.1", 0, control.handle).start()
    prefill, decode = TcpKVTransport(), TcpKVTransport()
    prefill.register(src)
    decode.register(dst)
    yield src, dst, clock, control, side, prefill, RemoteKVLoader(decode)
    side.close()
    prefill.close()
    decode.close()


def remote(side, transport_meta, blocks, request_id="p-1") -> RemotePrefill:
    layout = kv_layout("m", "float32", 2, 2, 8, 4)
    return RemotePrefill(
        "p0", request_id, "127.0.0.1", side.port, blocks, 11, 42, 30.0, transport_meta, layout
    )


def wait_result(loader, timeout_s=20):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        results = loader.poll()
        if results:
            return results
        time.sleep(0.01)
    raise AssertionError("no result")


def test_pull_skips_cached_blocks_and_frees_the_prefill_blocks_once(pair):
    src, dst, clock, control, side, prefill, loader = pair
    control.hold("p-1", [3, 4, 5])
    job = PullJob("d-1", remote(side, prefill.local_metadata(), [3, 4, 5]), [1, 2, 7], 1, 30)
    loader.submit(job)
    (result,) = wait_result(loader)
    assert result.error is None and result.request_id == "d-1"
    for s, d in zip(src, dst):
        assert torch.equal(d[[2, 7]], s[[4, 5]])
        assert torch.count_nonzero(d[1]) == 0  # the cached block was not read
    assert result.num_bytes == 2 * 2 * src[0][0].numel() * 4
    assert control.take_freed() == [("p-1", [3, 4, 5], "done")]
    assert control.num_pending_blocks == 0 and control.counts["claims"] == 1


def test_claim_of_a_gone_or_expired_entry_fails_without_reading(pair):
    src, dst, clock, control, side, prefill, loader = pair
    loader.submit(PullJob("d-1", remote(side, prefill.local_metadata(), [3]), [1], 0, 30))
    (result,) = wait_result(loader)
    assert result.error.startswith("claim:") and "'p-1' is not pending a send" in result.error
    control.hold("p-2", [6])
    clock.now = 31.0  # past the lease
    loader.submit(PullJob("d-2", remote(side, prefill.local_metadata(), [6], "p-2"), [2], 0, 30))
    (result,) = wait_result(loader)
    assert result.error.startswith("claim:")
    assert torch.count_nonzero(dst[0]) == 0
    assert control.take_freed() == [("p-2", [6], "expired")]


def test_everything_cached_here_needs_no_read_but_frees_the_prefill_side(pair):
    src, dst, clock, control, side, prefill, loader = pair
    control.hold("p-1", [3, 4])
    loader.submit(PullJob("d-1", remote(side, prefill.local_metadata(), [3, 4]), [1, 2], 2, 30))
    (result,) = wait_result(loader)
    assert result.error is None and result.num_bytes == 0
    assert control.take_freed() == [("p-1", [3, 4], "done")]


def test_cancel_ends_the_pull_and_aborts_the_prefill_blocks(pair):
    src, dst, clock, control, side, prefill, loader = pair
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    accepted = []
    threading.Thread(target=lambda: accepted.append(silent.accept()), daemon=True).start()
    try:
        control.hold("p-1", [3])
        meta = {"transport": "tcp", "host": "127.0.0.1", "port": silent.getsockname()[1]}
        loader.submit(PullJob("d-1", remote(side, meta, [3]), [1], 0, 60))
        time.sleep(0.3)
        assert loader.poll() == [] and loader.in_flight == 1
        loader.cancel("d-1")
        (result,) = wait_result(loader)
        assert result.error == "cancelled" and loader.in_flight == 0
        assert control.take_freed() == [("p-1", [3], "abort")]
    finally:
        silent.close()
        for conn, _ in accepted:
            conn.close()


def test_bad_job_is_refused():
    loader = RemoteKVLoader(TcpKVTransport())
    layout = kv_layout("m", "float32", 2, 2, 8, 4)
    far = RemotePrefill("p0", "p-1", "127.0.0.1", 1, [3, 4], 8, 1, 30.0, {}, layout)
    with pytest.raises(ValueError, match="1 local blocks and skip_blocks=0 for 2 remote blocks"):
        loader.submit(PullJob("d-1", far, [1], 0, 30))


# ---------------------------------------------------------------- the prompt fingerprint
def test_claim_of_another_prompts_blocks_fails_and_aborts_without_reading(pair):
    """The prefill node answers CLAIM with the fingerprint of the prompt it holds; a reference
    of the same length to another prompt's KV is never read (nor cached), and the prefill node
    frees the blocks at once."""
    src, dst, clock, control, side, prefill, loader = pair
    mine, theirs = prompt_fingerprint([1, 2, 3]), prompt_fingerprint([1, 2, 4])
    control.hold("p-1", [3, 4], theirs)
    far = dataclasses.replace(remote(side, prefill.local_metadata(), [3, 4]), prompt_hash=mine)
    loader.submit(PullJob("d-1", far, [1, 2], 0, 30))
    (result,) = wait_result(loader)
    assert result.error == (
        f"claim: the prefill node holds the KV of another prompt (prompt_hash {theirs!r}, this "
        f"request's is {mine!r})"
    )
    assert result.num_bytes == 0 and torch.count_nonzero(dst[0]) == 0
    assert control.take_freed() == [("p-1", [3, 4], "abort")]
    control.hold("p-2", [5], mine)  # the same prompt: read as usual
    ok = dataclasses.replace(remote(side, prefill.local_metadata(), [5], "p-2"), prompt_hash=mine)
    loader.submit(PullJob("d-2", ok, [6], 0, 30))
    (result,) = wait_result(loader)
    assert result.error is None and torch.equal(dst[0][6], src[0][5])


# ---------------------------------------------------------------- a pull's deadline
DEADLINE_S = 1.0
#: What a result may take past the deadline: the trailing ABORT's floor, plus scheduling on a
#: loaded 2-core machine.
SLACK_S = 0.6


@pytest.fixture
def stalled_peer():
    """A prefill node that stops answering: its side channel answers the ops in ``stall`` only
    once ``release`` is set; its tcp KV port accepts connections and never answers, or (with
    ``trickle``) answers the header and then one byte every 0.1 s."""
    release = threading.Event()
    stall: set[str] = set()
    control = PrefillControl(lease_s=30, transfer_s=30)

    def handler(op, message):
        if op in stall:
            release.wait(30)
        return control.handle(op, message)

    side = SideChannelServer("127.0.0.1", 0, handler).start()
    kv_port = socket.socket()
    kv_port.bind(("127.0.0.1", 0))
    kv_port.listen()
    conns = []

    def trickle():
        try:
            conn, _ = kv_port.accept()
        except OSError:
            return
        conns.append(conn)
        try:
            conn.makefile("rb").readline()
            block = 2 * 4 * 2 * 8 * 4
            conn.sendall(json.dumps({"ok": True, "num_layers": 2, "block_bytes": block}).encode())
            conn.sendall(b"\n")
            while not release.wait(0.1):
                conn.sendall(b"x")
        except OSError:
            return

    dst = [torch.zeros(SHAPE) for _ in range(2)]
    decode = TcpKVTransport()
    decode.register(dst)
    meta = {"transport": "tcp", "host": "127.0.0.1", "port": kv_port.getsockname()[1]}
    peer = SimpleNamespace(
        control=control, side=side, meta=meta, stall=stall, trickle=trickle, dst=dst
    )
    peer.loader = RemoteKVLoader(decode)
    try:
        yield peer
    finally:
        release.set()
        side.close()
        kv_port.close()
        for conn in conns:
            conn.close()
        decode.close()


def timed_pull(peer, request_id="d-1") -> tuple[str, float]:
    peer.control.hold("p-1", [3], None)
    t0 = time.monotonic()
    peer.loader.submit(PullJob(request_id, remote(peer.side, peer.meta, [3]), [1], 0, DEADLINE_S))
    (result,) = wait_result(peer.loader)
    return result.error, time.monotonic() - t0


def test_a_peer_stalled_after_claim_fails_the_pull_at_its_deadline(stalled_peer):
    """The prefill node answered CLAIM, then froze (its KV port and its side channel): the
    failure is reported at the deadline, not after the transfer's limit plus the ABORT's."""
    stalled_peer.stall.update({"ABORT", "DONE"})
    error, seconds = timed_pull(stalled_peer)
    assert DEADLINE_S - 0.05 <= seconds <= DEADLINE_S + SLACK_S, seconds
    assert error.startswith("transfer: ") and "deadline" in error


def test_a_peer_stalled_on_claim_fails_the_pull_at_its_deadline(stalled_peer):
    stalled_peer.stall.add("CLAIM")
    error, seconds = timed_pull(stalled_peer)
    assert DEADLINE_S - 0.05 <= seconds <= DEADLINE_S + SLACK_S, seconds
    assert error.startswith("claim: ") and "timed out" in error


def test_a_peer_trickling_bytes_fails_the_pull_at_its_deadline(stalled_peer):
    """A byte every 0.1 s resets any per-call socket timeout; the deadline is for the pull."""
    threading.Thread(target=stalled_peer.trickle, daemon=True).start()
    error, seconds = timed_pull(stalled_peer)
    assert DEADLINE_S - 0.05 <= seconds <= DEADLINE_S + SLACK_S, seconds
    assert error.startswith("transfer: ") and "deadline" in error
    assert stalled_peer.control.take_freed() == [("p-1", [3], "abort")]
