"""Keep the start-up heap out of the garbage collector's full collections.

After start-up a serving process holds hundreds of thousands of long-lived objects (torch, the
model's modules, the tokenizer, the web framework): 316K tracked objects in an engine process
with SmolLM2-135M, where one full (generation 2) collection took 108-156 ms on a 2-core VM.
Requests leave enough survivors that such a collection ran about once per 250 requests in both
the server and the engine process (CPU server, 512 requests: 2 more full collections in each),
and every one of them stalls all streams. :func:`freeze_startup_heap` collects once and moves
everything alive into the permanent generation (``gc.freeze``), so later full collections only
scan what was allocated since (a 1,024-request run then made one full collection, of 2.4 ms):
the same idea as vLLM's ``freeze_gc_heap`` after its engine and API server start.

The trade-off: reference counting still frees frozen objects, but a reference cycle that runs
through any object alive at the freeze is not freed by a collection, ``gc.collect()`` included,
until :func:`unfreeze_heap`. :meth:`LLMEngine.shutdown` calls it before its own collection, and a
new engine calls it (and collects) before it sizes its KV cache, so an engine dropped without
shutdown is freed then. In the offline ``LLM`` API the freeze covers the caller's objects too;
``FD_GC_FREEZE=0`` turns the freeze off (and this module then never unfreezes either, so an
application's own ``gc.freeze`` is left alone).
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)

_frozen_here = False  # whether the objects now frozen were frozen by freeze_startup_heap


def freeze_startup_heap(where: str, enabled: bool = True, keep_frozen: bool = False) -> int:
    """Collect once, then freeze every object alive into the permanent generation.

    What was frozen before (by an earlier call: a previous engine in the same process, or by the
    application) is unfrozen and collected first, so garbage from before is not kept; what of it
    is alive is frozen again.

    Args:
        where: the process's role, for the log line (``"engine"``, ``"api server"``).
        enabled: False does nothing (the caller passes ``envs.FD_GC_FREEZE()``).
        keep_frozen: when an earlier call of this function froze the heap, leave that frozen and
            collect and freeze only what was allocated since: a full collection of a heap with
            torch imported takes 0.3-0.4 s (H200 host), this one a few ms. The API server
            freezes early, while its engine loads, and again so just before serving.

    Returns:
        The number of objects now frozen (0 when not enabled).
    """
    global _frozen_here
    if not enabled:
        return 0
    if not (keep_frozen and _frozen_here):
        gc.unfreeze()
    gc.collect()
    gc.freeze()
    _frozen_here = True
    frozen = gc.get_freeze_count()
    logger.debug("%s: %d start-up objects frozen out of garbage collection", where, frozen)
    return frozen


def unfreeze_heap(collect: bool = False) -> bool:
    """Give the objects :func:`freeze_startup_heap` froze back to the collector (nothing when
    it froze none, so an application's own freeze is left alone).

    Args:
        collect: also run a full collection at once (their cycles are freed now).

    Returns:
        Whether there was a freeze of this module's to undo.
    """
    global _frozen_here
    if not _frozen_here:
        return False
    gc.unfreeze()
    _frozen_here = False
    if collect:
        gc.collect()
    return True
