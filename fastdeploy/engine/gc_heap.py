"""Keep the start-up heap out of the garbage collector's full collections.

After start-up a serving process holds hundreds of thousands of long-lived objects (torch, the
model's modules, the tokenizer, the web framework): 316K tracked objects in an engine process
with SmolLM2-135M, where one full (generation 2) collection took 113 ms on a 2-core VM. Requests
leave enough survivors that such a collection ran about once per 250 requests in both the
server and the engine process (CPU server, 512 requests: 2 more full collections in each,
120-156 ms apiece), and every one of them stalls all streams. :func:`freeze_startup_heap`
collects once and moves everything alive into the permanent generation (``gc.freeze``), so later
full collections only scan what was allocated since: the same idea as vLLM's ``freeze_gc_heap``
after its engine and API server start. Reference counting still frees frozen objects; only
cycles among them wait for :func:`unfreeze_heap`, which :meth:`LLMEngine.shutdown` calls before
its own collection, so a shut-down engine's cycles (and the GPU memory they hold) are freed.
``FD_GC_FREEZE=0`` turns the freeze off.
"""

from __future__ import annotations

import gc
import logging

from fastdeploy import envs

logger = logging.getLogger(__name__)


def freeze_startup_heap(where: str) -> int:
    """Collect once, then freeze every object alive into the permanent generation.

    Objects an earlier freeze left (a previous engine in the same process) are unfrozen and
    collected first, so garbage from before is not kept. Does nothing with ``FD_GC_FREEZE=0``.

    Args:
        where: the process's role, for the log line (``"engine"``, ``"api server"``).

    Returns:
        The number of objects now frozen (0 when turned off).

    Raises:
        ValueError: ``FD_GC_FREEZE`` is set to a value that is not a boolean.
    """
    if not envs.FD_GC_FREEZE():
        return 0
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.debug("%s: %d start-up objects frozen out of garbage collection", where, frozen)
    return frozen


def unfreeze_heap() -> None:
    """Give frozen objects back to the collector (the next full collection can free their
    cycles)."""
    gc.unfreeze()
