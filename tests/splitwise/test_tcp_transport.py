"""The ``tcp`` KV transport on CPU tensors: blocks land where asked and nowhere else, layout
mismatches and bad ids fail the pull with a reason, a dead or silent peer ends it."""

from __future__ import annotations

import socket
import threading

import pytest
import torch
from splitwise_utils import free_port

from fastdeploy.splitwise.tcp_transport import TcpKVTransport

SHAPE = (12, 2, 4, 2, 8)  # [num_blocks, K/V, block_size, kv_heads, head_dim]


def caches(dtype, fill: bool, layers: int = 3, shape=SHAPE) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if fill:
        return [torch.randn(shape, generator=g).to(dtype) for _ in range(layers)]
    return [torch.zeros(shape, dtype=dtype) for _ in range(layers)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pull_puts_each_block_where_asked(dtype):
    prefill, decode = TcpKVTransport(), TcpKVTransport()
    src, dst = caches(dtype, True), caches(dtype, False)
    prefill.register(src)
    decode.register(dst)
    try:
        transfer = decode.start_pull("r1", prefill.local_metadata(), [3, 4, 7], [1, 2, 5])
        assert transfer.wait(30) and transfer.error is None
        for s, d in zip(src, dst):
            assert torch.equal(d[[1, 2, 5]], s[[3, 4, 7]])
            untouched = [i for i in range(SHAPE[0]) if i not in (1, 2, 5)]
            assert torch.count_nonzero(d[untouched]) == 0
        per_block = SHAPE[1] * SHAPE[2] * SHAPE[3] * SHAPE[4] * src[0].element_size()
        assert transfer.num_bytes == 3 * 3 * per_block
    finally:
        prefill.close()
        decode.close()


def test_layout_mismatch_and_bad_ids_fail_with_the_reason():
    prefill, decode = TcpKVTransport(), TcpKVTransport()
    prefill.register(caches(torch.float32, True))
    decode.register(caches(torch.float32, False, shape=(12, 2, 8, 2, 8)))
    try:
        transfer = decode.start_pull("r1", prefill.local_metadata(), [3], [1])
        assert transfer.wait(30)
        assert "layout mismatch" in transfer.error and "here 3 of 1024 B" in transfer.error
        transfer = decode.start_pull("r2", prefill.local_metadata(), [0, 99], [1, 2])
        assert transfer.wait(30) and "block_ids outside 1..11" in transfer.error
    finally:
        prefill.close()
        decode.close()
    with pytest.raises(ValueError, match="2 remote blocks for 1 local blocks"):
        decode.start_pull("r3", prefill.local_metadata(), [1, 2], [1])


def test_only_authorized_blocks_and_at_most_a_pool_of_ids_are_served():
    prefill, decode = TcpKVTransport(), TcpKVTransport()
    src = caches(torch.float32, True)
    prefill.register(src)
    decode.register(caches(torch.float32, False))
    prefill.authorize = lambda ids: set(ids) <= {3, 4}
    try:
        meta = prefill.local_metadata()
        transfer = decode.start_pull("r1", meta, [3, 5], [1, 2])
        assert transfer.wait(30) and "not held for a claimed transfer" in transfer.error
        transfer = decode.start_pull("r2", meta, [3] * 13, [1] * 13)  # 13 ids, a pool of 12
        assert transfer.wait(30) and "at most 12 ids" in transfer.error
        transfer = decode.start_pull("r3", meta, [4, 3], [1, 2])
        assert transfer.wait(30) and transfer.error is None
        assert torch.equal(decode.kv_caches[0][[1, 2]], src[0][[4, 3]])
    finally:
        prefill.close()
        decode.close()


def test_dead_peer_and_cancel_end_the_pull():
    decode = TcpKVTransport()
    decode.register(caches(torch.float32, False))
    dead = {"transport": "tcp", "host": "127.0.0.1", "port": free_port()}
    transfer = decode.start_pull("r1", dead, [1], [1], timeout_s=5)
    assert transfer.wait(10) and "ConnectionRefusedError" in transfer.error
    # A peer that accepts and never answers: cancel ends the pull.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    accepted = []
    threading.Thread(target=lambda: accepted.append(silent.accept()), daemon=True).start()
    try:
        remote = {"transport": "tcp", "host": "127.0.0.1", "port": silent.getsockname()[1]}
        transfer = decode.start_pull("r2", remote, [1], [1], timeout_s=60)
        assert not transfer.wait(0.5)
        transfer.cancel()
        assert transfer.wait(10) and transfer.error == "cancelled"
    finally:
        silent.close()
        for conn, _ in accepted:
            conn.close()
