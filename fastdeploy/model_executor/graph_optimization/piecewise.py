"""Piecewise CUDA graphs: the forward split at attention, each piece captured per token bucket.

A decoder model of ``L`` layers is cut into ``L + 1`` segments around its ``L`` attention calls::

    seg 0     : embed(input_ids) -> layer[0].pre_attention            -> q, k, v, residual
    attention : backend.forward(q, k, v, kv_cache[0]) (eager)         -> attn
    seg i     : layer[i-1].post_attention(attn) -> layer[i].pre_attention -> q, k, v, residual
    ...
    seg L     : layer[L-1].post_attention(attn) -> final_norm         -> hidden

Once attention runs outside the graphs, what the segments launch depends only on the total token
count, so one capture per token bucket serves any split of the tokens across requests (one long
prompt, many short ones, chunks mixed with decode tokens). No ``torch.compile`` is needed at
``graph_opt_level=0``; levels 1 and 2 compile each segment with Inductor before capture.

Every segment reads and writes the same persistent buffers (``SegmentBuffers``, sized for the
largest bucket and sliced per bucket), so the graphs of all buckets share their inputs and outputs
and the memory pool holds only the segments' intermediates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch


def capture_graph(
    fn: Callable[[], object], pool, stream: torch.cuda.Stream
) -> torch.cuda.CUDAGraph:
    """Capture ``fn()`` into a new graph in ``pool`` on ``stream``.

    ``torch.cuda.graph`` synchronises the device and empties the allocator cache on every entry;
    over thousands of segment graphs that dominated capture time, so capture is begun and ended
    directly (the caller synchronises once per bucket, after its warm-up runs).
    """
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool)
        try:
            fn()
        finally:
            graph.capture_end()
    return graph


class SegmentBuffers:
    """Static tensors that segments read and write, sized for ``max_tokens`` rows.

    Attributes (rows ``[:n]`` are used by a bucket of ``n`` tokens):
        qkv ``[max_tokens, q_size + 2 * kv_size]``: the merged QKV projection writes here
        (``pre_attention(qkv_out=...)``), so no copy follows it; q ``[max_tokens, q_size]``
        and k/v ``[max_tokens, kv_size]`` are its column views (row stride ``q_size + 2 *
        kv_size``), as a split of the projection's output would be. With ``merged_qkv=False``
        (the ``torch.compile`` levels: Inductor rejects segment inputs that are views of one
        another's storage) ``qkv`` is None and q/k/v are separate buffers the segments copy to;
        residual/hidden ``[max_tokens, hidden_size]``, attn ``[max_tokens, q_size]`` (the
        attention output the next segment reads), all of the model dtype.
    """

    def __init__(
        self,
        max_tokens: int,
        hidden_size: int,
        q_size: int,
        kv_size: int,
        dtype: torch.dtype,
        device: torch.device,
        merged_qkv: bool = True,
    ) -> None:
        def buf(width: int) -> torch.Tensor:
            return torch.zeros(max_tokens, width, dtype=dtype, device=device)

        if merged_qkv:
            self.qkv: torch.Tensor | None = buf(q_size + 2 * kv_size)
            self.q, self.k, self.v = self.qkv.split([q_size, kv_size, kv_size], dim=-1)
        else:
            self.qkv = None
            self.q, self.k, self.v = buf(q_size), buf(kv_size), buf(kv_size)
        self.residual, self.hidden, self.attn = buf(hidden_size), buf(hidden_size), buf(q_size)


class PiecewiseAttention(Protocol):
    """A layer's attention handle: its index into ``ForwardMeta.kv_caches``."""

    layer_idx: int


class PiecewiseLayer(Protocol):
    """One decoder layer, split at its attention call (``T`` tokens, model dtype)."""

    attn: PiecewiseAttention

    def pre_attention(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        qkv_out: torch.Tensor | None = None,
        kv_store: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """int64 ``positions [T]``, ``hidden_states [T, hidden]``, ``residual [T, hidden]``
        (None entering the first layer) -> ``q [T, H*D]``, ``k, v [T, KV*D]``,
        ``residual [T, hidden]``. ``qkv_out [T, (H + 2*KV)*D]``: where the merged projection
        writes (the segments' buffer); what is returned may be views of it. ``kv_store``:
        ``(kv_cache, slot_mapping)`` where the layer also stores its rotated K and its V."""
        ...

    def post_attention(
        self, attn_output: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``attn_output [T, H*D]``, ``residual [T, hidden]`` -> ``(hidden_states, residual)``,
        both ``[T, hidden]``."""
        ...


class PiecewiseModel(Protocol):
    """What a model file offers so that its forward can be cut into piecewise segments.

    The forward must equal ``embed -> for each layer: pre_attention, attention,
    post_attention -> final_norm``; nothing but attention may depend on how the step's tokens
    are split across requests. :class:`~fastdeploy.model_executor.models.llama.DecoderForCausalLM`
    is the reference implementation.
    """

    hidden_size: int
    layers: Sequence[PiecewiseLayer]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """int64 ``[T]`` -> ``[T, hidden]``."""
        ...

    def final_norm(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The last residual add and norm: ``[T, hidden]`` each -> ``[T, hidden]``."""
        ...


def make_segments(
    model: PiecewiseModel,
    bufs: SegmentBuffers,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_stores: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> list[Callable[[], None]]:
    """The ``L + 1`` segment callables for a bucket of ``n = input_ids.numel()`` tokens.

    Each callable takes no argument: it reads ``input_ids``/``positions`` (views of the runner's
    persistent buffers) and the ``bufs`` views, and writes its results into ``bufs`` in place.
    With ``kv_stores`` (entry ``i``: layer ``i``'s ``(kv_cache, slot_mapping)``, the slot
    mapping a persistent buffer) each segment also stores the K/V of the layer whose attention
    follows it, in that layer's RoPE kernel (``pre_attention(kv_store=...)``), so that the eager
    attention between segments only attends (one launch less per layer on the host's critical
    path, and one kernel less per layer on the GPU) and must be called with ``write_kv=False``.
    """
    n = input_ids.shape[0]
    qkv = None if bufs.qkv is None else bufs.qkv[:n]
    q, k, v = bufs.q[:n], bufs.k[:n], bufs.v[:n]
    residual, hidden, attn = bufs.residual[:n], bufs.hidden[:n], bufs.attn[:n]
    layers = model.layers

    def store(i: int, out: tuple[torch.Tensor, ...]) -> None:
        # q/k/v written by the projection into ``qkv`` are in place already (the RoPE kernel
        # rotates them there): only tensors made elsewhere (a q/k norm's output) are copied.
        # Under torch.compile (levels 1, 2) every one is copied: dynamo cannot trace
        # data_ptr(), and Inductor plans the copies itself.
        compiling = torch.compiler.is_compiling()
        for dst, src in zip((q, k, v, residual), out):
            if compiling or src.data_ptr() != dst.data_ptr():
                dst.copy_(src)

    def kv(i: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if kv_stores is None else kv_stores[i]

    def first() -> None:
        h = model.embed(input_ids)
        store(0, layers[0].pre_attention(positions, h, None, qkv, kv(0)))

    def middle(i: int) -> Callable[[], None]:
        def seg() -> None:
            h, res = layers[i - 1].post_attention(attn, residual)
            store(i, layers[i].pre_attention(positions, h, res, qkv, kv(i)))

        return seg

    def last() -> None:
        h, res = layers[-1].post_attention(attn, residual)
        hidden.copy_(model.final_norm(h, res))

    return [first, *(middle(i) for i in range(1, len(layers))), last]


def compile_segments(
    segments: list[Callable[[], None]], graph_opt_level: int
) -> list[Callable[[], None]]:
    """Wrap each segment in ``torch.compile`` (Inductor, its own CUDA graphs off) for
    ``graph_opt_level`` 1, or 2 with max-autotune; level 0 returns the segments unchanged.

    The middle segments of all layers and buckets share one code object and differ only in the
    layer they close over, so each is a recompile of it: dynamo's recompile limits are raised to
    hold them all, or the segments past the limit would silently run uncompiled.
    """
    if graph_opt_level == 0:
        return segments
    import torch._dynamo.config as dynamo_config

    # Grow the limits by this bucket's segments (the counts accumulate over buckets).
    dynamo_config.recompile_limit += len(segments)
    dynamo_config.accumulated_recompile_limit += len(segments)
    mode = "max-autotune-no-cudagraphs" if graph_opt_level == 2 else None
    return [torch.compile(s, fullgraph=True, dynamic=False, mode=mode) for s in segments]


class PiecewiseGraph:
    """The captured segments of one token bucket, and their replay.

    Args:
        num_tokens: the bucket size.
        segments: from :func:`make_segments` (optionally wrapped by ``torch.compile``).
        bufs: the shared segment buffers.
        attn_layers: the model's attention layers in order (their ``layer_idx`` picks the cache).
        kv_in_segments: the segments write each layer's K/V (``make_segments(kv_stores=...)``),
            so the attention between them does not.
    """

    def __init__(
        self,
        num_tokens: int,
        segments: list[Callable[[], None]],
        bufs: SegmentBuffers,
        attn_layers: list,
        kv_in_segments: bool = False,
    ) -> None:
        self.num_tokens = num_tokens
        self.write_kv = not kv_in_segments
        self.segments = segments
        self.graphs: list[torch.cuda.CUDAGraph] = []
        # Views made once, so a replay does no slicing.
        self.q, self.k, self.v = bufs.q[:num_tokens], bufs.k[:num_tokens], bufs.v[:num_tokens]
        self.attn = bufs.attn[:num_tokens]
        self.hidden = bufs.hidden[:num_tokens]
        self.layer_ids = [a.layer_idx for a in attn_layers]

    def run_eager(self, forward_meta) -> torch.Tensor:
        """The same computation without graphs (warm-up runs, and a reference in tests)."""
        self.segments[0]()
        for i, seg in enumerate(self.segments[1:]):
            self._attention(i, forward_meta)
            seg()
        return self.hidden

    def capture(self, pool, stream: torch.cuda.Stream) -> None:
        """Capture every segment into its own graph, sharing ``pool``."""
        for seg in self.segments:
            self.graphs.append(capture_graph(seg, pool, stream))

    def replay(self, forward_meta) -> torch.Tensor:
        """Replay the segments with eager attention between them; returns ``[num_tokens, H]``
        (a view of the shared hidden buffer: consume it before the next step)."""
        graphs = self.graphs
        attend = forward_meta.attn_backend.segment_attention(
            self.q, self.k, self.v, self.attn, forward_meta.attn_metadata, self.write_kv
        )
        caches = forward_meta.kv_caches
        graphs[0].replay()
        for layer_id, graph in zip(self.layer_ids, graphs[1:]):
            attend(caches[layer_id])
            graph.replay()
        return self.hidden

    def _attention(self, i: int, forward_meta) -> None:
        # The split op: about one kernel launch of Python, writing where segment i+1 reads.
        out = forward_meta.attn_backend.forward(
            self.q,
            self.k,
            self.v,
            forward_meta.kv_caches[self.layer_ids[i]],
            forward_meta.attn_metadata,
            out=self.attn,
            write_kv=self.write_kv,
        )
        if out.data_ptr() != self.attn.data_ptr():
            self.attn.copy_(out)
