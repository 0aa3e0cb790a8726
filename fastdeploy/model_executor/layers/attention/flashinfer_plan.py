"""Prefill and CUDA-graph decode plans of flashinfer without its Python ``plan``.

``BatchPrefillWithPagedKVCacheWrapper.plan`` (flashinfer 0.5.3) spends most of its host time
outside the compiled scheduler it calls: it moves the host arrays to the CPU (a no-op here), takes
the longest query and KV length with Python's ``max`` over tensors, and makes three host-to-device
copies into new tensors plus one into its KV-length buffer. Measured on an H200 host at 16 tokens
(SmolLM2-135M heads): 69.5 us a plan, of which 10.7 us in the compiled ``plan``.

:class:`PrefillPlanner` makes the first plan of a wrapper through ``plan`` and later ones, where
the wrapper is the one this was written against, by doing what ``plan`` does for them: set the
step's attributes ``run`` reads (batch size, longest lengths, the device arrays) and call the
compiled ``plan`` with the arguments ``plan`` passes. The static arguments (heads, head size,
page size, and :data:`STATIC_KEYWORDS`: causality, scale, dtypes) are those of the first plan; a
call with others, or with any other keyword, goes through ``plan``. The device arrays come
from one packed copy
(:meth:`~fastdeploy.model_executor.layers.attention.flashinfer_staging.PlanStaging.stage_prefill`).
Measured on an H200 host whose Python ran slowly (a loop of a million additions: about 130 ms),
16 tokens, SmolLM2-135M heads, p50 of 300 plans: staging and plan 101.1 us (30.7 staging, 70.4
``plan``) -> 35.8 us (21.5 staging, 14.3 plan, of which 10.1 in the compiled scheduler); the
step's whole attention metadata 182.5 -> 105.0 us.

"The one this was written against": flashinfer 0.5.3's wrapper (:data:`DIRECT_VERSIONS`) on its
``fa2`` backend, not in CUDA-graph mode, with no JIT variant, custom mask or multi-item scoring,
and with the private attributes read below. Anything else plans through ``plan``. The
wrapper's KV-length buffer (``_kv_lens_buffer``) is not written: the fa2 kernels do not read it
(only the trtllm-gen and cudnn backends do). A GPU test compares the plans and the attention
output of both paths (``tests/gpu/test_attention_gpu.py``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from fastdeploy.model_executor.layers.attention.flashinfer_staging import (
    GraphDecodeArrays,
    PrefillArrays,
)

#: flashinfer versions whose ``BatchPrefillWithPagedKVCacheWrapper.plan`` the direct plan mirrors.
DIRECT_VERSIONS = ("0.5.3",)
#: ``plan`` keyword arguments the direct plan takes over from the first plan; a plan with any
#: other keyword (``window_left``, ``head_dim_vo``, ``fixed_split_size``, ...) always goes through
#: ``plan``, since the direct call passes their defaults.
STATIC_KEYWORDS = frozenset({"causal", "sm_scale", "q_data_type", "kv_data_type"})
#: Wrapper attributes the direct plan reads or sets; a wrapper lacking one plans through ``plan``.
_ATTRIBUTES = (
    "_backend", "_jit_module", "_cached_module", "_float_workspace_buffer",
    "_int_workspace_buffer", "_pin_memory_int_workspace_buffer", "_custom_mask_buf",
    "_prefix_len_ptr", "_max_total_num_rows", "_qo_indptr_buf", "_paged_kv_indptr_buf",
    "_paged_kv_indices_buf", "_paged_kv_last_page_len_buf", "_plan_info",
)  # fmt: skip


def direct_plan_supported(wrapper: Any, version: str) -> bool:
    """Whether :class:`PrefillPlanner` may plan ``wrapper`` without ``plan`` (module docstring),
    judged after a first ``plan`` on it; ``version`` is flashinfer's ``__version__``."""
    return (
        version in DIRECT_VERSIONS
        and all(hasattr(wrapper, name) for name in _ATTRIBUTES)
        and wrapper._backend == "fa2"
        and wrapper._jit_module is None
        and not wrapper.is_cuda_graph_enabled
        and wrapper._custom_mask_buf is None
        and wrapper._prefix_len_ptr is None
        and wrapper._max_total_num_rows is None
        and callable(getattr(wrapper._cached_module, "plan", None))
    )


class PrefillPlanner:
    """Plans one flashinfer prefill wrapper per step (module docstring).

    Args:
        wrapper: a ``BatchPrefillWithPagedKVCacheWrapper``.
        version: flashinfer's ``__version__``.
    """

    def __init__(self, wrapper: Any, version: str) -> None:
        self.wrapper = wrapper
        self.version = version
        self._static: dict[str, Any] | None = None  # the first plan's static arguments
        self.direct_plans = 0  # plans made without ``plan`` (for tests and diagnosis)

    def plan(
        self,
        arrays: PrefillArrays,
        num_tokens: int,
        max_query_len: int,
        max_seq_len: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        **static: Any,
    ) -> None:
        """Plan the wrapper for one step.

        Args:
            arrays: the step's arrays (``R`` requests, no padding requests).
            num_tokens: the step's query tokens (``qo_indptr[R]``).
            max_query_len / max_seq_len: the longest query and KV length of the step, in tokens.
            num_heads, num_kv_heads, head_dim, page_size: the attention shape.
            **static: ``plan``'s keyword arguments (:data:`STATIC_KEYWORDS` for a direct plan;
                any other keeps every plan on ``plan``); ``seq_lens`` is taken from ``arrays``.

        Raises:
            whatever flashinfer's ``plan`` or its compiled scheduler raises (a length that does
            not fit, a CUDA error).
        """
        key = dict(static, shape=(num_heads, num_kv_heads, head_dim, page_size))
        w = self.wrapper
        if self._static is None or key != self._static:
            self._static = None
            # Host arrays, as the backend always gave them: from device ones ``plan`` would copy
            # back to the host, which waits for the device.
            w.plan(
                arrays.qo_indptr, arrays.kv_indptr, arrays.page_ids_dev, arrays.last_page_len,
                num_heads, num_kv_heads, head_dim, page_size, seq_lens=arrays.seq_lens, **static,
            )  # fmt: skip
            if static.keys() <= STATIC_KEYWORDS and direct_plan_supported(w, self.version):
                self._static = key
            return
        n = arrays.seq_lens.shape[0]
        w._batch_size = n
        w._max_q_len = max_query_len
        w._max_kv_len = max_seq_len
        w._qo_indptr_buf = arrays.qo_indptr_dev
        w._paged_kv_indptr_buf = arrays.kv_indptr_dev
        w._paged_kv_indices_buf = arrays.page_ids_dev
        w._paged_kv_last_page_len_buf = arrays.last_page_len_dev
        w._seq_lens_kv = w._seq_lens_q = arrays.seq_lens
        w._plan_info = w._cached_module.plan(
            w._float_workspace_buffer, w._int_workspace_buffer,
            w._pin_memory_int_workspace_buffer, arrays.qo_indptr, arrays.kv_indptr,
            arrays.seq_lens, num_tokens, n, num_heads, num_kv_heads, page_size,
            False,  # CUDA-graph mode
            head_dim, head_dim, static.get("causal", False),
            -1,  # window_left
            -1,  # fixed_split_size
            False,  # disable_split_kv
            0,  # num_colocated_ctas
        )  # fmt: skip
        self.direct_plans += 1


#: Wrapper attributes the direct graph decode plan reads or sets (flashinfer 0.5.3
#: ``BatchDecodeWithPagedKVCacheWrapper``); a wrapper lacking one plans through ``plan``.
_DECODE_ATTRIBUTES = (
    "_backend", "_jit_module", "_cached_module", "_float_workspace_buffer",
    "_int_workspace_buffer", "_pin_memory_int_workspace_buffer", "_fixed_batch_size",
    "_paged_kv_indptr_buf", "_paged_kv_indices_buf", "_paged_kv_last_page_len_buf",
    "_plan_info", "_batch_size",
)  # fmt: skip


def direct_decode_plan_supported(wrapper: Any, version: str) -> bool:
    """Whether :class:`GraphDecodePlanner` may plan the CUDA-graph decode ``wrapper`` without
    ``plan``, judged after a first ``plan`` on it: flashinfer 0.5.3, CUDA-graph mode, the
    CUDA-core kernel (not tensor cores, not trtllm-gen) and no JIT variant."""
    return (
        version in DIRECT_VERSIONS
        and all(hasattr(wrapper, name) for name in _DECODE_ATTRIBUTES)
        and wrapper.is_cuda_graph_enabled
        and not wrapper.use_tensor_cores
        and wrapper._backend != "trtllm-gen"
        and wrapper._jit_module is None
        and callable(getattr(wrapper._cached_module, "plan", None))
    )


class GraphDecodePlanner:
    """Plans the CUDA-graph decode wrappers of the CUDA-core decode kernel without flashinfer's
    Python ``plan``.

    For such a wrapper, flashinfer 0.5.3's ``BatchDecodeWithPagedKVCacheWrapper.plan`` checks
    dtypes, copies ``kv_indptr``, ``kv_last_page_len`` and the page ids into the wrapper's fixed
    buffers (three copies), derives every request's KV length on the host (which this kernel's
    scheduler does not read), canonicalises the dtypes and then calls the compiled scheduler
    with the host ``kv_indptr``. The backend already has the three arrays packed in one pinned
    buffer and moves them to the fixed buffers with one copy
    (:meth:`~fastdeploy.model_executor.layers.attention.flashinfer_staging.PlanStaging.stage_graph_decode`),
    so a direct plan only calls the compiled scheduler with the arguments ``plan`` passes and
    stores its result as ``plan`` does. The first plan of each wrapper (before its capture) goes
    through ``plan``; so does every plan of a wrapper that
    :func:`direct_decode_plan_supported` refuses, or with another shape than the first. A GPU
    test compares the schedule both paths leave in the int workspace and the attention output
    (``tests/gpu/test_graph_decode_gpu.py``).

    Args:
        version: flashinfer's ``__version__``.
        device: the wrappers' CUDA device.
    """

    def __init__(self, version: str, device: torch.device) -> None:
        self.version = version
        self.device = device
        # wrapper -> the shape and dtypes of its first plan (weak: a wrapper made later at a
        # recycled address must plan through plan() first).
        self._direct: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._empty: dict[torch.dtype, torch.Tensor] = {}
        self.direct_plans = 0  # plans made without ``plan`` (for tests and diagnosis)

    def plan(
        self,
        wrapper: Any,
        arrays: GraphDecodeArrays,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        *,
        q_data_type: torch.dtype,
        kv_data_type: torch.dtype,
        sm_scale: float,
    ) -> None:
        """Plan ``wrapper`` for one step whose arrays are staged (and their copy to the fixed
        buffers queued) in ``arrays``.

        Raises:
            whatever flashinfer's ``plan`` or its compiled scheduler raises.
        """
        key = (num_heads, num_kv_heads, head_dim, page_size, q_data_type, kv_data_type, sm_scale)
        w = wrapper
        if self._direct.get(w) != key:
            self._direct.pop(w, None)
            # The fixed buffers already hold the arrays (queued copy); plan() copies them again,
            # the same data. The page ids go on the device: plan() copies host indices into its
            # buffer with a blocking copy, which would wait for the step the GPU is running.
            page_ids = arrays.page_ids.to(self.device, non_blocking=True)
            w.plan(
                arrays.kv_indptr, page_ids, arrays.last_page_len, num_heads,
                num_kv_heads, head_dim, page_size, q_data_type=q_data_type,
                kv_data_type=kv_data_type, sm_scale=sm_scale,
            )  # fmt: skip
            if direct_decode_plan_supported(w, self.version):
                self._direct[w] = key
            return
        batch_size = arrays.last_page_len.shape[0]
        if batch_size != w._fixed_batch_size:
            raise ValueError(
                f"a graph decode wrapper of batch {w._fixed_batch_size} planned for {batch_size}"
            )
        w._batch_size = batch_size
        w._plan_info = w._cached_module.plan(
            w._float_workspace_buffer, w._int_workspace_buffer,
            w._pin_memory_int_workspace_buffer, arrays.kv_indptr, batch_size, num_heads,
            num_kv_heads, page_size,
            True,  # CUDA-graph mode
            -1,  # window_left
            0.0,  # logits_soft_cap
            head_dim, head_dim, self._empty_of(q_data_type), self._empty_of(kv_data_type),
        )  # fmt: skip
        self.direct_plans += 1

    def _empty_of(self, dtype: torch.dtype) -> torch.Tensor:
        """The empty CPU tensor ``plan`` passes to name a dtype (made once per dtype)."""
        empty = self._empty.get(dtype)
        if empty is None:
            empty = self._empty[dtype] = torch.empty(0, dtype=dtype)
        return empty
