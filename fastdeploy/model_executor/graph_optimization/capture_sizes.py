"""Capture sizes (buckets) of CUDA graphs: the default ladder, and the bucket a step replays.

Decode buckets count requests (one token each); prefill/mixed buckets count tokens. Bucket lists are
kept largest first, the order in which they are captured (smaller graphs then reuse the memory pool
blocks of the larger ones). A step of ``n`` requests or tokens replays the smallest bucket ``>= n``
and pads the difference; see ``docs/graph-optimization.md`` in the shared docs.
"""

from __future__ import annotations

from fastdeploy.config.plan import normalize_sizes, pick_bucket

# normalize_sizes and pick_bucket live with GraphPlan (fastdeploy.config.plan), whose dispatch
# applies them; they are importable from here too, beside the ladders.
__all__ = [
    "MAX_DEFAULT_DECODE_SIZE",
    "capture_ladder",
    "default_decode_sizes",
    "default_prefill_sizes",
    "normalize_sizes",
    "num_padding",
    "pick_bucket",
]

# Largest default decode bucket: beyond it a decode step is long enough that launch overhead
# (what a graph saves) is a small share of the step, and each graph costs capture time and memory.
MAX_DEFAULT_DECODE_SIZE = 512

# (first, last, step) runs of the default ladder, from the specification.
_LADDER_RUNS = (
    (8, 128, 8),
    (144, 256, 16),
    (288, 1024, 32),
    (1088, 2048, 64),
    (2304, 4096, 256),
    (4608, 8192, 512),
)


def capture_ladder(cap: int) -> list[int]:
    """The default ladder up to ``cap``, plus ``cap`` itself, deduplicated, largest first.

    The ladder is 1, 2, 4; 8..128 step 8; 144..256 step 16; 288..1024 step 32; 1088..2048 step 64;
    2304..4096 step 256; 4608..8192 step 512. Entries above ``cap`` are dropped and ``cap`` is
    added, so the largest batch the limit allows is always served by a graph.

    Raises:
        ValueError: ``cap`` is not a positive integer.
    """
    if not isinstance(cap, int) or isinstance(cap, bool) or cap < 1:
        raise ValueError(f"cap={cap!r} is invalid; allowed: an integer >= 1")
    sizes = {1, 2, 4, cap}
    for first, last, step in _LADDER_RUNS:
        sizes.update(range(first, last + 1, step))
    return sorted((s for s in sizes if s <= cap), reverse=True)


def default_decode_sizes(max_num_seqs: int) -> list[int]:
    """Default decode buckets (requests): the ladder up to ``min(512, max_num_seqs)``, descending.

    Example: ``default_decode_sizes(20) == [20, 16, 8, 4, 2, 1]``.
    """
    return capture_ladder(min(MAX_DEFAULT_DECODE_SIZE, max_num_seqs))


def default_prefill_sizes(max_capture_shape_prefill: int, max_num_batched_tokens: int) -> list[int]:
    """Default prefill/mixed buckets (tokens): the ladder up to
    ``min(max_capture_shape_prefill, max_num_batched_tokens)``, largest first.
    """
    return capture_ladder(min(max_capture_shape_prefill, max_num_batched_tokens))


def num_padding(bucket: int, n: int) -> int:
    """Padded entries (requests or tokens) when ``n`` real ones replay graph ``bucket``.

    Raises:
        ValueError: ``n < 1`` or ``n > bucket`` (a graph serves at most what it was captured for).
    """
    if n < 1 or n > bucket:
        raise ValueError(f"n={n!r} is invalid; allowed: 1 <= n <= bucket={bucket}")
    return bucket - n
