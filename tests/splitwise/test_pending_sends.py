"""The prefill node's pending-send table and the kv_transfer_params checks of the decode node."""

from __future__ import annotations

import pytest

from fastdeploy.splitwise.pending_sends import PendingSends
from fastdeploy.splitwise.protocol import (
    RemotePrefill,
    is_prefill_leg,
    kv_layout,
    prompt_fingerprint,
)

LAYOUT = kv_layout("m", "bfloat16", 30, 3, 64, 64)


def test_lease_claim_heartbeat_done_and_expiry():
    table = PendingSends(lease_s=10, transfer_s=5)
    table.add("a", [1, 2], now=0)
    table.add("b", [3], now=0)
    assert table.num_blocks == 3 and len(table) == 2
    with pytest.raises(ValueError, match="'a' is already pending"):
        table.add("a", [9], now=1)
    assert table.claim("a", now=1) == [1, 2]
    with pytest.raises(KeyError, match="already claimed"):
        table.claim("a", now=2)  # one claim per request
    assert table.heartbeat(["b", "zzz"], now=9) == ["zzz"]  # b now lives until 19
    assert [e.request_id for e in table.sweep(now=6.5)] == ["a"]  # claimed: deadline 1 + 5
    assert table.sweep(now=18) == [] and "b" in table
    assert table.release("b") == [3] and table.release("b") is None
    assert table.num_blocks == 0


def test_an_expired_entry_cannot_be_claimed():
    table = PendingSends(lease_s=2, transfer_s=2)
    table.add("a", [1], now=0)
    with pytest.raises(KeyError, match="'a' is not pending a send"):
        table.claim("a", now=2)
    assert [e.block_ids for e in table.sweep(now=2)] == [[1]]
    with pytest.raises(ValueError, match="pd_lease_s=0 is invalid"):
        PendingSends(0, 1)


def params(**changes) -> dict:
    base = RemotePrefill(
        "p0", "req-1", "127.0.0.1", 5601, [4, 5], 100, 42, 30.0, {"transport": "tcp"}, LAYOUT
    ).to_dict() | {"prompt_hash": prompt_fingerprint(range(100))}
    base.update(changes)
    return base


def test_remote_prefill_round_trips_and_refuses_what_it_cannot_use():
    assert RemotePrefill.from_params(params(), LAYOUT).remote_block_ids == [4, 5]
    assert is_prefill_leg({"do_remote_decode": True}) and not is_prefill_leg({"x": 1})
    with pytest.raises(ValueError, match="kv_transfer_params='x' is invalid"):
        RemotePrefill.from_params("x", LAYOUT)
    with pytest.raises(ValueError, match="missing or mistypes remote_port, first_token_id"):
        RemotePrefill.from_params(params(remote_port="5601", first_token_id=None), LAYOUT)
    with pytest.raises(ValueError, match="block ids > 0"):
        RemotePrefill.from_params(params(remote_block_ids=[0, 1]), LAYOUT)
    with pytest.raises(ValueError, match="missing or mistypes prompt_hash"):
        RemotePrefill.from_params(params(prompt_hash=None), LAYOUT)
    with pytest.raises(ValueError, match="prompt_hash='md5:00' is invalid; allowed: 'sha256:'"):
        RemotePrefill.from_params(params(prompt_hash="md5:00"), LAYOUT)
    other = kv_layout("m", "float16", 30, 3, 64, 16)
    with pytest.raises(ValueError) as err:
        RemotePrefill.from_params(params(), other)
    message = str(err.value)
    assert "dtype: prefill 'bfloat16' != decode 'float16'" in message
    assert "block_size: prefill 64 != decode 16" in message


def test_only_claimed_live_entries_are_readable():
    from fastdeploy.splitwise.prefill_control import PrefillControl

    now = [0.0]
    control = PrefillControl(lease_s=10, transfer_s=5, clock=lambda: now[0])
    control.hold("a", [1, 2])
    control.hold("b", [3])
    assert not control.readable([1])  # held, not claimed yet
    control.handle("CLAIM", {"request_ids": ["a"]})
    assert control.readable([1, 2]) and control.readable([2])
    assert not control.readable([1, 3])  # b is unclaimed
    now[0] = 6.0  # past a's transfer deadline (0 + 5)
    assert not control.readable([1])


def test_prompt_fingerprint_is_sha256_of_little_endian_int64_ids():
    import hashlib
    import struct

    ids = [0, 1, 49151, 2**40]
    want = hashlib.sha256(struct.pack("<4q", *ids)).hexdigest()
    assert prompt_fingerprint(ids) == "sha256:" + want
    assert prompt_fingerprint([1, 2, 3]) != prompt_fingerprint([1, 2, 4])
    assert prompt_fingerprint([1, 2]) != prompt_fingerprint([2, 1])


def test_claim_answers_the_prompt_fingerprint_and_a_refusal_abort_spares_claimed_entries():
    from fastdeploy.splitwise.prefill_control import PrefillControl

    control = PrefillControl(lease_s=10, transfer_s=5, clock=lambda: 0.0)
    control.hold("a", [1, 2], "sha256:" + "a" * 64)
    control.hold("b", [3], "sha256:" + "b" * 64)
    reply = control.handle("CLAIM", {"request_ids": ["a"]})
    assert reply == {"block_ids": {"a": [1, 2]}, "prompt_hashes": {"a": "sha256:" + "a" * 64}}
    # A refused decode leg's ABORT frees only entries no decode node has claimed.
    control.handle("ABORT", {"request_ids": ["a", "b"], "unclaimed_only": True})
    assert control.take_freed() == [("b", [3], "abort")]
    control.handle("ABORT", {"request_ids": ["a"]})  # the claimer's own ABORT frees it
    assert control.take_freed() == [("a", [1, 2], "abort")]
