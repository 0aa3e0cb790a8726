"""Block hashes follow vLLM v0.11.0's scheme: recomputed here independently, as a router would,
from the token ids alone (pickle/CBOR + SHA-256, NONE_HASH from PYTHONHASHSEED, low 64 bits)."""

from __future__ import annotations

import hashlib
import pickle

import cbor2
import pytest

from fastdeploy.cache_manager import block_hash
from fastdeploy.cache_manager.kv_cache_manager import KVCacheManager
from fastdeploy.core.request import Request
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.distributed.kv_events import BlockStored

BS = 4


def router_hashes(tokens: list[int], seed: str, cbor: bool = False) -> list[int]:
    """What a router computes: vLLM's chain, written from its description, not our code."""

    def digest(obj) -> bytes:
        data = cbor2.dumps(obj, canonical=True) if cbor else pickle.dumps(obj, protocol=5)
        return hashlib.sha256(data).digest()

    parent = digest(seed)  # NONE_HASH = hash_fn(PYTHONHASHSEED)
    out = []
    for i in range(len(tokens) // BS):
        parent = digest((parent, tuple(tokens[i * BS : (i + 1) * BS]), None))
        out.append(int.from_bytes(parent, "big") & (2**64 - 1))
    return out


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_engine_hashes_equal_a_routers(monkeypatch, algo):
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    block_hash.init_none_hash(algo)
    tokens = [5, 17, 9000, 3, 3, 3, 42, 1, 49151, 0, 7, 8, 2]  # 3 full blocks, 1 partial
    kv = KVCacheManager(17, BS, hash_algo=algo, enable_kv_cache_events=True)
    r = Request("a", tokens, SamplingParams(max_tokens=4))
    kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, len(tokens))
    kv.cache_full_blocks(r, len(tokens))
    (event,) = kv.take_events()
    assert isinstance(event, BlockStored)
    expected = router_hashes(tokens, "1234", cbor=algo == "sha256_cbor")
    assert len(expected) == 3
    assert event.block_hashes == expected
    assert event.parent_block_hash is None
    assert event.token_ids == tokens[:12]
    assert (event.block_size, event.lora_id, event.medium) == (BS, None, "GPU")
    block_hash.init_none_hash(algo)  # the next test draws its own


def test_none_hash_is_random_without_pythonhashseed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    first = block_hash.init_none_hash("sha256")
    second = block_hash.init_none_hash("sha256")
    assert len(first) == 32 and first != second
    assert block_hash.none_hash("sha256") == second
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    seeded = block_hash.init_none_hash("sha256")
    assert seeded == hashlib.sha256(pickle.dumps("0", protocol=5)).digest()
    assert block_hash.hash_block_tokens(None, [1, 2]) == block_hash.sha256((seeded, (1, 2), None))


def test_external_hash_is_the_low_64_bits_big_endian():
    h = bytes(range(32))
    assert block_hash.external_block_hash(h) == int.from_bytes(bytes(range(24, 32)), "big")
    assert block_hash.external_block_hash(b"\xff" * 32) == 2**64 - 1


def test_unknown_hash_algo_names_the_choices():
    with pytest.raises(
        ValueError,
        match=r"prefix_caching_hash_algo='md5' is invalid; allowed: "
        r"sha256, sha256_cbor",
    ):
        KVCacheManager(5, BS, hash_algo="md5")
