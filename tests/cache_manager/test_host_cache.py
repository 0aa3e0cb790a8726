"""The host tier's prefix cache: published only after the copy, pins fence eviction, LRU, and the
integrity check after every operation of random interleavings (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastdeploy.cache_manager.host_cache import HostPrefixCache


def h(i: int) -> bytes:
    return i.to_bytes(4, "big")


def test_unpublished_blocks_never_hit_and_are_not_evicted():
    cache = HostPrefixCache(2)
    a = cache.reserve(h(1))
    assert a == 0 and cache.contains(h(1)) and cache.lookup(h(1)) is None
    assert cache.reserve(h(1)) is None  # already on the host (storing)
    b = cache.reserve(h(2))
    assert cache.reserve(h(3)) is None  # both storing: nothing can be evicted
    cache.publish(a)
    assert cache.lookup(h(1)) == a and cache.match_prefix([h(1), h(2)]) == [a]
    cache.publish(b)
    assert cache.match_prefix([h(1), h(2), h(9)]) == [a, b]
    cache.check_integrity()


def test_lru_eviction_skips_pinned_blocks():
    cache = HostPrefixCache(2)
    for i in (1, 2):
        cache.publish(cache.reserve(h(i)))
    cache.match_prefix([h(1)])  # 1 is now the most recently used
    c = cache.reserve(h(3))
    assert c is not None and cache.lookup(h(2)) is None and cache.lookup(h(1)) is not None
    cache.publish(c)
    cache.pin([cache.lookup(h(1)), c])
    assert cache.reserve(h(4)) is None  # everything pinned
    cache.unpin([c])
    d = cache.reserve(h(4))
    assert d == c and cache.lookup(h(3)) is None and cache.lookup(h(1)) is not None
    cache.check_integrity()


def test_cancel_frees_and_misuse_is_loud():
    cache = HostPrefixCache(1)
    a = cache.reserve(h(1))
    cache.cancel(a)
    assert cache.num_free == 1 and not cache.contains(h(1))
    with pytest.raises(ValueError, match="host block 0 is not storing"):
        cache.publish(0)
    with pytest.raises(ValueError, match="not published"):
        cache.pin([0])
    with pytest.raises(ValueError, match="not pinned"):
        cache.unpin([0])
    with pytest.raises(ValueError, match="num_blocks=0 is invalid"):
        HostPrefixCache(0)


OPS = st.lists(
    st.tuples(st.sampled_from(["reserve", "publish", "cancel", "pin", "unpin", "match"]),
              st.integers(0, 9)),
    max_size=80,
)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(OPS)
def test_integrity_holds_after_every_operation(ops):
    cache = HostPrefixCache(4)
    storing, pins = [], []
    for op, k in ops:
        if op == "reserve":
            block = cache.reserve(h(k))
            if block is not None:
                storing.append(block)
        elif op == "publish" and storing:
            cache.publish(storing.pop(k % len(storing)))
        elif op == "cancel" and storing:
            cache.cancel(storing.pop(k % len(storing)))
        elif op == "pin":
            block = cache.lookup(h(k))
            if block is not None:
                cache.pin([block])
                pins.append((block, k))
        elif op == "unpin" and pins:
            cache.unpin([pins.pop(k % len(pins))[0]])
        elif op == "match":
            cache.match_prefix([h(k), h(k + 1)])
        cache.check_integrity()
        for block, key in pins:  # a pinned block is never evicted or overwritten
            assert cache.lookup(h(key)) == block
