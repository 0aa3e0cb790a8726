"""Host KV pool on CPU: blocks go to and come back from the host exactly, runs are merged, and
sizing names the host's memory when asked for too much."""

from __future__ import annotations

import pytest
import torch

from fastdeploy.worker.host_kv_pool import HostKVPool, host_blocks_for, host_memory_bytes

SHAPE = (9, 2, 4, 2, 8)


def test_store_then_load_round_trips_blocks():
    g = torch.Generator().manual_seed(0)
    kv = [torch.randn(SHAPE, generator=g) for _ in range(3)]
    pool = HostKVPool(5, SHAPE[1:], 3, torch.float32, torch.device("cpu"))
    assert pool.bytes_per_block == 3 * 2 * 4 * 2 * 8 * 4
    job = pool.store(kv, [2, 3, 7], [0, 1, 4])
    assert job.done()
    for layer, host in zip(kv, pool.layers):
        assert torch.equal(host[[0, 1, 4]], layer[[2, 3, 7]])
    back = [torch.zeros(SHAPE) for _ in range(3)]
    assert pool.load(back, [0, 1, 4], [5, 6, 1], per_layer=True).done()
    for layer, restored in zip(kv, back):
        assert torch.equal(restored[[5, 6, 1]], layer[[2, 3, 7]])
        assert torch.count_nonzero(restored[[0, 2, 3, 4, 7, 8]]) == 0


def test_sizing():
    assert host_blocks_for(1, 1 << 20) == 1024
    with pytest.raises(ValueError, match=r"swap_space=100000 GiB is invalid.*this host's"):
        host_blocks_for(100000, 1 << 20)
    with pytest.raises(ValueError, match="holds no KV block"):
        host_blocks_for(1e-9, 1 << 20)
    assert host_memory_bytes() > 1 << 30
