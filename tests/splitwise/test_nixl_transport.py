"""The ``nixl`` KV transport on CPU tensors (UCX over loopback), and the transport choice.

Skipped where ``nixl`` does not import; ``make_transport`` is tested either way."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import uuid

import pytest
import torch

from fastdeploy.splitwise.transport_select import make_transport

SHAPE = (12, 2, 4, 2, 8)
HAS_NIXL = importlib.util.find_spec("nixl") is not None
needs_nixl = pytest.mark.skipif(not HAS_NIXL, reason="nixl is not installed (pip install nixl)")

PEER = r"""
import json, sys, time, torch
from fastdeploy.splitwise.nixl_transport import NixlKVTransport
t = NixlKVTransport(sys.argv[1])
g = torch.Generator().manual_seed(1)
kv = [torch.randn(SHAPE, generator=g) for _ in range(3)]
t.register(kv)
print(json.dumps(t.local_metadata()), flush=True)
time.sleep(600)
""".replace("SHAPE", repr(SHAPE))


def test_make_transport_choice(monkeypatch):
    with pytest.raises(ValueError, match="cache_transfer_protocol='udp' is invalid"):
        make_transport("udp")
    assert make_transport("tcp").name == "tcp"
    assert make_transport("auto", name=f"t-{uuid.uuid4().hex}").name == (
        "nixl" if HAS_NIXL else "tcp"
    )
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "nixl" else real(n, *a)
    )
    with pytest.raises(ValueError, match="'nixl' but nixl is not installed"):
        make_transport("nixl")
    assert make_transport("auto").name == "tcp"


@needs_nixl
def test_pull_between_two_agents_and_layout_check():
    from fastdeploy.splitwise.nixl_transport import NixlKVTransport

    g = torch.Generator().manual_seed(0)
    src = [torch.randn(SHAPE, generator=g) for _ in range(3)]
    dst = [torch.zeros(SHAPE) for _ in range(3)]
    prefill = NixlKVTransport(f"p-{uuid.uuid4().hex}")
    decode = NixlKVTransport(f"d-{uuid.uuid4().hex}")
    prefill.register(src)
    decode.register(dst)
    remote = json.loads(json.dumps(prefill.local_metadata()))  # as it travels in JSON
    transfer = decode.start_pull("r1", remote, [3, 4, 5, 9], [1, 2, 7, 8])
    assert transfer.wait(30) and transfer.error is None, transfer.error
    for s, d in zip(src, dst):
        assert torch.equal(d[[1, 2, 7, 8]], s[[3, 4, 5, 9]])
        assert torch.count_nonzero(d[[0, 3, 4, 5, 6, 9, 10, 11]]) == 0
    assert transfer.num_bytes == 4 * 3 * dst[0][0].numel() * 4
    with pytest.raises(ValueError, match="layout mismatch"):
        decode.start_pull("r2", {**remote, "block_bytes": 8}, [1], [1])


@pytest.mark.slow
@needs_nixl
def test_killed_peer_fails_the_pull():
    from fastdeploy.splitwise.nixl_transport import NixlKVTransport

    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    peer = subprocess.Popen(
        [sys.executable, "-c", PEER, f"p-{uuid.uuid4().hex}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        line = peer.stdout.readline()
        while line and not line.startswith("{"):  # NIXL logs to stdout first
            line = peer.stdout.readline()
        remote = json.loads(line)
        decode = NixlKVTransport(f"d-{uuid.uuid4().hex}")
        decode.register([torch.zeros(SHAPE) for _ in range(3)])
        first = decode.start_pull("r1", remote, [2], [2])
        assert first.wait(30) and first.error is None, first.error
        peer.kill()
        peer.wait(10)
        second = decode.start_pull("r2", remote, [3], [3], timeout_s=10)
        assert second.wait(30)
        assert second.error is not None
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait(10)
