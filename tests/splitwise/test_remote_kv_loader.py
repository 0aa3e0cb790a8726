"""Decode-side pulls against a real prefill-side control channel and tcp transports (CPU): the
blocks land, the prefill node frees exactly once, and every failure path says why."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
from support import ManualClock

from fastdeploy.splitwise.prefill_control import PrefillControl
from fastdeploy.splitwise.protocol import RemotePrefill, kv_layout
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
