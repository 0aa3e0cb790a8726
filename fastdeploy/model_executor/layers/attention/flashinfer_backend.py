"""Paged attention with flashinfer, the default backend on CUDA.

Kernels and the plan/run split come from flashinfer (Z. Ye et al. 2025, "FlashInfer: Efficient and
Customizable Attention Engine for LLM Inference Serving", https://github.com/flashinfer-ai/flashinfer;
API of flashinfer-python 0.5.3). The KV cache is flashinfer's "NHD" paged layout
``[num_blocks, 2, block_size, num_kv_heads, head_dim]``; a request's pages are described in CSR
form (``kv_indptr``, ``kv_indices``, ``kv_last_page_len``).

One step = one ``plan()`` (in :meth:`FlashInferAttentionBackend.build_metadata`, host work and a
few small host-to-device copies) and one ``run()`` per layer (in ``forward``):

* prefill, chunked prefill and mixed steps: ``BatchPrefillWithPagedKVCacheWrapper`` (ragged queries
  over the paged cache, causal with the mask aligned to the end of each sequence, so cached
  prefixes and chunk continuations work; grouped-query heads natively);
* decode-only steps: ``BatchDecodeWithPagedKVCacheWrapper``; for a full CUDA graph, one decode
  wrapper per bucket in CUDA-graph mode (see :meth:`FlashInferAttentionBackend.plan_graph_decode`).

``forward`` runs eagerly between piecewise graph segments, so it does no planning and no
per-request work: one Triton KV write and one flashinfer ``run``.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any

import torch

from custom_ops.kv_cache_ops import write_kv_cache
from fastdeploy import envs
from fastdeploy.core.host_staging import record_event
from fastdeploy.model_executor.layers.attention.backend import AttentionBackend, AttentionBatch
from fastdeploy.model_executor.layers.attention.flashinfer_direct import LayerAttention
from fastdeploy.model_executor.layers.attention.flashinfer_graph_decode import GraphDecode
from fastdeploy.model_executor.layers.attention.flashinfer_layout import (  # noqa: F401 - re-exported
    WORKSPACE_BYTES,
    WORKSPACE_MARGIN_BYTES,
    FlashInferMetadata,
    PagedKVLayout,
    float_workspace_bytes,
    paged_kv_layout,
)
from fastdeploy.model_executor.layers.attention.flashinfer_plan import PrefillPlanner
from fastdeploy.model_executor.layers.attention.flashinfer_staging import (
    PlanStaging,
    host_page_ids,
)

#: Int workspace (the plan's schedule) shared by the CUDA-graph decode wrappers; flashinfer's size.
INT_WORKSPACE_BYTES = 8 << 20
#: Context length assumed for sizing the graph page-index buffer when ``max_num_blocks`` is unset.
DEFAULT_MAX_MODEL_LEN = 32768


#: GQA groups (query heads per KV head) that flashinfer's CUDA-core decode kernel is built for.
CUDA_CORE_DECODE_GROUPS = (1, 2, 3, 4, 8)
#: Smallest GQA group that decodes on tensor cores when FD_FLASHINFER_USE_TENSOR_CORES is unset.
TENSOR_CORE_MIN_GROUP = 4


def decode_uses_tensor_cores(num_heads: int, num_kv_heads: int) -> bool:
    """Whether decode steps run flashinfer's tensor-core kernel (its prefill kernel with the
    group's query heads packed as rows) instead of its CUDA-core decode kernel.

    ``FD_FLASHINFER_USE_TENSOR_CORES`` decides when set. Unset: groups of at least
    :data:`TENSOR_CORE_MIN_GROUP` query heads per KV head, and any group the CUDA-core kernel
    lacks (:data:`CUDA_CORE_DECODE_GROUPS`).

    Raises:
        ValueError: the variable asks for the CUDA-core kernel with a group it lacks.
    """
    group = num_heads // num_kv_heads
    forced = envs.FD_FLASHINFER_USE_TENSOR_CORES()
    if forced is False and group not in CUDA_CORE_DECODE_GROUPS:
        raise ValueError(
            f"FD_FLASHINFER_USE_TENSOR_CORES=0 needs flashinfer's CUDA-core decode kernel, which "
            f"has no GQA group of {group} query heads per KV head ({num_heads}/{num_kv_heads}); "
            f"groups it has: {', '.join(map(str, CUDA_CORE_DECODE_GROUPS))}"
        )
    if forced is not None:
        return forced
    return group >= TENSOR_CORE_MIN_GROUP or group not in CUDA_CORE_DECODE_GROUPS


class FlashInferAttentionBackend(AttentionBackend):
    """flashinfer paged attention (prefill/extend, decode, decode in full CUDA graphs).

    Args:
        num_heads, num_kv_heads, head_dim, block_size, dtype, device: see
            :class:`AttentionBackend`; ``dtype`` float16 or bfloat16, ``device`` CUDA.
        max_num_reqs: largest decode bucket a CUDA graph is captured for (``max_num_seqs``).
        max_num_blocks: capacity of the fixed page-index buffer that decode graphs read: at least
            the pages of a full batch, ``max_num_seqs * ceil(max_model_len / block_size)``
            (prefix-shared blocks count once per request). Default: that for a 32k context.
        prefill_backend: flashinfer's prefill implementation: ``"fa2"`` (default; one kernel
            per run), ``"fa3"`` (Hopper; adds an index-conversion kernel per run and compiles
            longer) or ``"auto"`` (fa3 where supported).

    Raises:
        ImportError: flashinfer is not installed (imported here so CPU hosts can import the module).
        ValueError: a non-CUDA device, a dtype other than float16/bfloat16, ``num_heads`` not a
            multiple of ``num_kv_heads``, or a non-positive size.

    Owns a float workspace of :func:`float_workspace_bytes` (128 MiB or more), an 8 MiB int
    workspace and the decode graphs' part (:attr:`graph_decode`, a
    :class:`~fastdeploy.model_executor.layers.attention.flashinfer_graph_decode.GraphDecode`:
    the fixed-size graph buffers and their planner).
    """

    name = "flashinfer"
    supports_graph_decode = True

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        max_num_reqs: int = 256,
        max_num_blocks: int | None = None,
        prefill_backend: str = "fa2",
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, block_size, dtype, device)
        try:
            import flashinfer
        except ImportError as e:
            raise ImportError(f"the flashinfer backend needs flashinfer-python ({e})") from e
        if self.device.type != "cuda":
            raise ValueError(f"the flashinfer backend needs a CUDA device, got {self.device}")
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"the flashinfer backend supports float16 and bfloat16, got {dtype}")
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}"
            )
        if max_num_blocks is None:
            max_num_blocks = max_num_reqs * math.ceil(DEFAULT_MAX_MODEL_LEN / block_size)
        if max_num_reqs < 1 or max_num_blocks < 1:
            raise ValueError(
                f"max_num_reqs={max_num_reqs} and max_num_blocks={max_num_blocks} must be positive"
            )
        self._flashinfer = flashinfer
        self.max_num_reqs = max_num_reqs
        self.max_num_blocks = max_num_blocks
        self.use_tensor_cores = decode_uses_tensor_cores(num_heads, num_kv_heads)
        dev = self.device
        props = torch.cuda.get_device_properties(dev)
        size = float_workspace_bytes(
            num_heads, num_kv_heads, head_dim, props.multi_processor_count,
            max_graph_decode_batch=max_num_reqs if self.use_tensor_cores else 0,
            sm_major=props.major,
        )  # fmt: skip
        self.workspace = torch.zeros(size, dtype=torch.uint8, device=dev)
        self._int_workspace = torch.zeros(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend=prefill_backend
        )
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores
        )
        self._plan_events: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # see _plan
        self._staging = PlanStaging(max_num_reqs, max_num_blocks, dev)
        # Prefill plans without flashinfer's Python plan() where that is safe (flashinfer_plan).
        self._prefill_planner = (
            PrefillPlanner(self.prefill_wrapper, getattr(flashinfer, "__version__", ""))
            if envs.FD_FLASHINFER_DIRECT_PLAN()
            else None
        )
        self.graph_decode = GraphDecode(
            flashinfer, self.workspace, self._int_workspace, self.use_tensor_cores,
            max_num_reqs, max_num_blocks, block_size, dev, self._staging,
        )  # fmt: skip
        self._kv_views: dict[int, tuple] = {}  # see bind_kv_caches

    # ------------------------------------------------------------------ planning
    def build_metadata(self, batch: AttentionBatch) -> FlashInferMetadata:
        """Plan the step (once per step, all layers share it) from the batch's host lengths.

        Decode-only steps plan the decode wrapper, all others the prefill wrapper (causal,
        ragged queries over the pages). Host work plus small asynchronous copies (no device sync
        in the engine's step loop; see :meth:`_plan`).

        Raises:
            ValueError: lengths that do not fit the block table (see :func:`paged_kv_layout`).
        """
        if batch.num_reqs == 0:
            return FlashInferMetadata(None, 0, batch.slot_mapping)
        layout = paged_kv_layout(
            batch.query_lens_host, batch.seq_lens_host, self.block_size, batch.block_tables.shape[1]
        )
        page_ids = host_page_ids(batch, layout)
        shape = (self.num_heads, self.num_kv_heads, self.head_dim, self.block_size)
        static = dict(causal=True, sm_scale=self.scale, q_data_type=self.dtype,
                      kv_data_type=self.dtype)  # fmt: skip
        arrays = None
        if not batch.is_decode_only and self._prefill_planner is not None:
            arrays = self._staging.stage_prefill(layout, page_ids, batch.seq_lens_host)
        if arrays is not None:
            wrapper = self.prefill_wrapper
            try:
                self._plan(
                    wrapper, arrays, batch.num_tokens, batch.max_query_len, batch.max_seq_len,
                    *shape, plan_fn=self._prefill_planner.plan, **static,
                )  # fmt: skip
            finally:  # the packed copy is queued even when the plan fails
                self._staging.queued()
            return FlashInferMetadata(wrapper, batch.num_tokens, batch.slot_mapping)
        layout, indices = self._staging.stage(layout, batch, page_ids)
        if batch.is_decode_only:
            wrapper = self.decode_wrapper
            self._plan_decode(wrapper, layout.kv_indptr, indices, layout.kv_last_page_len)
        else:
            wrapper = self.prefill_wrapper
            self._plan(
                wrapper, layout.qo_indptr, layout.kv_indptr, indices, layout.kv_last_page_len,
                *shape, seq_lens=self._staging.seq_lens(batch.seq_lens_host), **static,
            )  # fmt: skip
        self._staging.queued()
        return FlashInferMetadata(wrapper, batch.num_tokens, batch.slot_mapping)

    def _plan_decode(
        self, wrapper: Any, *arrays: Any, plan_fn: Callable[..., None] | None = None
    ) -> None:
        """Plan a decode ``wrapper`` (``wrapper.plan`` or ``plan_fn``) with ``arrays`` followed
        by the backend's shape and dtypes (see ``_plan``)."""
        shape = (self.num_heads, self.num_kv_heads, self.head_dim, self.block_size)
        self._plan(
            wrapper, *arrays, *shape, plan_fn=plan_fn,
            q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale,
        )  # fmt: skip

    # ------------------------------------------------------------------ decode graphs
    def make_graph_decode_metadata(self, batch_size: int) -> FlashInferMetadata:
        """Prepare for capture: a CUDA-graph decode wrapper for a bucket of ``batch_size``
        requests, bound to the fixed metadata buffers (:meth:`GraphDecode.make_metadata` says
        the capture protocol).

        Raises:
            ValueError: ``batch_size`` outside ``1..max_num_reqs``.
        """
        return self.graph_decode.make_metadata(batch_size)

    def plan_graph_decode(
        self, graph_metadata: FlashInferMetadata, batch: AttentionBatch, batch_size: int
    ) -> FlashInferMetadata:
        """Prepare for replay: re-plan the bucket's wrapper for this step, in place, before
        every replay of its graph (:meth:`GraphDecode.plan`).

        Raises:
            ValueError: wrong bucket, not decode-only, too many requests or pages, unpadded rows.
            RuntimeError: the slot mapping is not at the address the graph was captured with.
        """
        return self.graph_decode.plan(graph_metadata, batch, batch_size, self._plan_decode)

    def _plan(
        self, wrapper: Any, *args: Any, plan_fn: Callable[..., None] | None = None, **kwargs: Any
    ) -> None:
        """``wrapper.plan(...)`` (``plan_fn(...)`` when given), first waiting until this
        wrapper's previous plan has been copied to the device: plan() writes its schedule into a
        pinned host buffer of the wrapper and copies it asynchronously, so re-planning before
        that copy ran would corrupt it. In the engine a step's sampled tokens are synchronised,
        so the event is complete and this costs nothing; it only guards callers that plan twice
        without a sync."""
        done = self._plan_events.get(wrapper)
        if done is None:
            done = self._plan_events[wrapper] = torch.cuda.Event()
        else:
            done.synchronize()
        (plan_fn or wrapper.plan)(*args, **kwargs)
        record_event(done)

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Keep ``(k_cache, v_cache)`` views of each layer's cache and their strides, made
        once: flashinfer unbinds a single cache tensor on every ``run``, a few microseconds of
        host time per layer on the eager path between piecewise segments. ``[]`` drops them
        (the views hold the caches' memory)."""
        self._kv_views = {}
        for c in kv_caches:
            k, v = c.unbind(1)
            self._kv_views[id(c)] = (c, (k, v), (k.stride(), v.stride()))
        if not kv_caches:  # the engine releases its graphs with its caches
            self.graph_decode.forget_plan()

    # ------------------------------------------------------------------ forward
    def segment_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        metadata: FlashInferMetadata,
        write_kv: bool,
    ) -> Callable[[torch.Tensor], None]:
        """:meth:`forward` for every layer of one piecewise step, with the per-step work
        (head views, row checks, zeroing the padding rows of ``out``, which ``run`` never
        writes, and flashinfer's argument building: :class:`LayerAttention`) done once: per
        layer it is one kernel launch on the bound cache views (:meth:`bind_kv_caches`),
        after the K/V write when ``write_kv``.

        Raises:
            ValueError: the metadata was planned for more tokens than ``q`` has rows.
        """
        return self._attention(q, k, v, out, metadata, write_kv, LayerAttention)

    def _attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        metadata: FlashInferMetadata,
        write_kv: bool,
        runner: Callable[[Any, torch.Tensor, torch.Tensor], Callable[[Any, Any], None]],
    ) -> Callable[[torch.Tensor], None]:
        """The attention of one step as a function of a layer's cache (see
        :meth:`segment_attention`); ``runner(wrapper, q3, o3)`` makes the per-layer call
        ``run(kv, strides)`` (``strides``: of the bound ``(k, v)`` views, else None)."""
        md = metadata
        rows, n = q.shape[0], md.num_tokens
        if n > rows:
            raise ValueError(f"metadata planned for {n} tokens, q has {rows} rows")
        if n < rows:
            out[n:].zero_()
        q3 = q.view(rows, self.num_heads, self.head_dim)[:n]
        o3 = out.view(rows, self.num_heads, self.head_dim)[:n]
        run = runner(md.wrapper, q3, o3) if n else None
        views, slots = self._kv_views, md.slot_mapping

        def attend(kv_cache: torch.Tensor) -> None:
            if write_kv:
                write_kv_cache(k, v, kv_cache, slots)
            if run is not None:
                entry = views.get(id(kv_cache))
                if entry is not None and entry[0] is kv_cache:
                    run(entry[1], entry[2])
                else:
                    run(kv_cache, None)

        return attend

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: FlashInferMetadata,
        out: torch.Tensor | None = None,
        write_kv: bool = True,
    ) -> torch.Tensor:
        """Write this step's K/V (Triton, slot -1 skipped), then one flashinfer ``run``.

        Args:
            q: ``[T, num_heads * head_dim]``; k, v: ``[T, num_kv_heads * head_dim]`` (row-strided
                views such as a split of a fused QKV projection are fine), the backend's dtype.
            kv_cache: ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``.
            metadata: from :meth:`build_metadata` or :meth:`plan_graph_decode` for this step.
            out: optional contiguous ``[T, num_heads * head_dim]`` result buffer.

        Returns:
            ``[T, num_heads * head_dim]`` (``out`` when given); rows past ``metadata.num_tokens``
            are zero. With graph decode metadata all ``T`` (= bucket) rows are computed and the
            padding requests' rows are not meaningful.

        Raises:
            ValueError: the metadata was planned for more tokens than ``q`` has rows.
        """
        if out is None:
            out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        self._attention(q, k, v, out, metadata, write_kv, _plain_run)(kv_cache)
        return out


def _plain_run(wrapper: Any, q: torch.Tensor, out: torch.Tensor) -> Callable[[Any, Any], None]:
    """``kv -> wrapper.run(q, kv, out=out)``: one call, nothing to record."""

    def run(kv: Any, strides: Any = None) -> None:
        wrapper.run(q, kv, out=out)

    return run
