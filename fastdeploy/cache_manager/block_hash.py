"""Block hashes in vLLM's scheme, so a router that re-tokenizes a prompt computes the engine's
hashes (vLLM v0.11.0, ``vllm/v1/core/kv_cache_utils.py`` and ``vllm/utils/hashing.py``).

The hash of full block ``i`` of a sequence is::

    h_i = hash_fn((h_{i-1} if i > 0 else NONE_HASH, tuple(token ids of block i), None))

``hash_fn`` is ``--prefix-caching-hash-algo``:

* ``sha256``: SHA-256 of ``pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)`` (32 bytes);
* ``sha256_cbor``: SHA-256 of ``cbor2.dumps(obj, canonical=True)`` (language-neutral; needs
  the ``cbor2`` package).

``NONE_HASH`` (the parent of every first block) is ``hash_fn(os.environ["PYTHONHASHSEED"])``
(the variable's string) when that is set, else 32 random bytes drawn once per process, as vLLM
does: processes (and routers) share block hashes only when they share ``PYTHONHASHSEED``.

KV events carry a hash as vLLM does by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``): the
unsigned integer of its last 8 bytes, big-endian (:func:`external_block_hash`).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

BlockHash = bytes


def sha256(obj: Any) -> bytes:
    """SHA-256 of ``obj`` pickled with the highest protocol (vLLM's ``sha256``); 32 bytes."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(obj: Any) -> bytes:
    """SHA-256 of ``obj`` as canonical CBOR (vLLM's ``sha256_cbor``); 32 bytes.

    Raises:
        ImportError: the ``cbor2`` package is not installed.
    """
    import cbor2

    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


HASH_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {"sha256": sha256, "sha256_cbor": sha256_cbor}

_none_hashes: dict[str, BlockHash] = {}


def get_hash_fn(algo: str) -> Callable[[Any], bytes]:
    """The hash function named ``algo``.

    Raises:
        ValueError: an unknown name, listing the allowed ones.
    """
    try:
        return HASH_FUNCTIONS[algo]
    except KeyError:
        raise ValueError(
            f"prefix_caching_hash_algo={algo!r} is invalid; allowed: {', '.join(HASH_FUNCTIONS)}"
        ) from None


def init_none_hash(algo: str) -> BlockHash:
    """(Re)draw ``NONE_HASH`` of ``algo`` from ``PYTHONHASHSEED`` now (random when unset or
    empty) and return it; later hashes of first blocks use it."""
    seed = os.environ.get("PYTHONHASHSEED")
    value = get_hash_fn(algo)(seed) if seed else os.urandom(32)
    _none_hashes[algo] = value
    return value


def none_hash(algo: str) -> BlockHash:
    """``NONE_HASH`` of ``algo``, drawn on first use in this process (:func:`init_none_hash`)."""
    value = _none_hashes.get(algo)
    return value if value is not None else init_none_hash(algo)


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], algo: str = "sha256"
) -> BlockHash:
    """The chain hash of one full block: ``hash_fn((parent or NONE_HASH, tuple(ids), None))``.

    Args:
        parent_hash: the previous block's hash, ``None`` for the first block.
        token_ids: exactly ``block_size`` token ids (Python ints).
        algo: a name of :data:`HASH_FUNCTIONS`.
    """
    parent = parent_hash if parent_hash is not None else none_hash(algo)
    return HASH_FUNCTIONS[algo]((parent, tuple(token_ids), None))


def external_block_hash(block_hash: BlockHash) -> int:
    """The hash as KV events carry it: the unsigned int of its last 8 bytes, big-endian (vLLM's
    ``maybe_convert_block_hash`` with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` on, its default)."""
    return int.from_bytes(block_hash[-8:], "big")
