"""KV-cache events in vLLM's wire format: msgspec structs encoded as msgpack.

The structs match vLLM v0.11.0 (``vllm/distributed/kv_events.py``): array-like (a struct is a
msgpack array of its fields in order, trailing defaults omitted) and events tagged with their
class name as the array's first element, so vLLM's own decoder, Dynamo's, llm-d's and SGLang's
read them. An :class:`KVEventBatch` goes out as one message per engine step with events:

* ``BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium)``:
  consecutive full blocks entered a prefix cache; ``token_ids`` holds every token of those
  blocks (``len(block_hashes) * block_size`` ids; empty for host-tier stores, whose token ids
  the host tier does not keep, as vLLM's offloading connector sends them);
  ``parent_block_hash`` is the hash of the block before the first one (``None``: the first
  block of a sequence);
* ``BlockRemoved(block_hashes, medium)``: blocks left the cache (eviction);
* ``AllBlocksCleared()``: the whole cache was emptied.

Hashes are unsigned 64-bit ints (see
:func:`fastdeploy.cache_manager.block_hash.external_block_hash`). ``medium`` is ``"GPU"`` for the
device KV cache (also on a CPU-only engine, where it names the tier, as in vLLM) and ``"CPU"``
for the host tier.
"""

from __future__ import annotations

from typing import Any

import msgspec

#: ``medium`` of the device KV cache's events (vLLM's ``MEDIUM_GPU``) and of the host tier's.
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published message: wall-clock ``ts`` (seconds since the epoch, float) and the
    events of one engine step, in the order they happened."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class of the KV-cache events (tagged with the class name on the wire)."""


class BlockStored(KVCacheEvent):
    """Full blocks entered a prefix cache (see the module docstring)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    """Blocks left a prefix cache."""

    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """Every block of the cache was dropped."""


class KVEventBatch(EventBatch):
    """:class:`EventBatch` typed for decoding."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
