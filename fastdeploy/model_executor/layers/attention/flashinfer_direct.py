"""One flashinfer ``run`` per step, then the same kernel launched directly for the other layers.

Between piecewise graph segments the host runs attention once per layer, and at small token
counts the host is the bottleneck: flashinfer 0.5.3's ``BatchPrefillWithPagedKVCacheWrapper.run``
re-derives the same 42 kernel arguments from the wrapper's plan on every call (dtype and shape
checks, PDL support, the alibi-slope buffer, the mask mode), which took 13.3 us of host time per
call on the H200 host at 16 tokens (SmolLM2-135M heads), against 7.2 us for the compiled
module's ``paged_run`` method alone with the same arguments. Within one step only the layer's cache
changes, so :class:`LayerAttention` lets ``run`` build the arguments once, for the first layer,
records the one call it makes into the wrapper's compiled module, and for every later layer calls
that function again with the cache tensors swapped. The outputs are the same (same kernel, same
arguments); a GPU test compares them.

flashinfer's prefill module method is itself a Python function (its ``paged_run``: 42
parameters, a backend switch and, on the fa2 backend, a dtype assertion) around the compiled
function it holds in a closure cell named ``paged_run_func``. Where the recorded method has
exactly one cell of that name and the first layer's call makes exactly one positional call
through it, with the cache tensors among its arguments exactly once, later layers call the
compiled function directly with those arguments; otherwise the method, as above (so does the
CUDA-core decode wrapper, whose module holds its compiled function in a cell of another name:
that path was not measured). Measured on an H200 host (SmolLM2-135M heads, 16 tokens, 30
layers): 302.7 -> 270.7 us of host time for the step's 30 attention calls, and 459.5 -> 435.3
us when the same host ran slower. The cell belongs to a module that flashinfer caches per
configuration, shared by every wrapper of it: during the first layer's call it holds a
recorder that records only the recording thread's calls and passes any other thread's through,
a second recording never starts while one is active, and the cell gets its function back
afterwards, also when the call raises.

This reads private attributes of flashinfer's wrappers (``_cached_module``, whose method
``run`` calls, the positional arguments it passes, and that method's closure cell). Where they
do not look as expected (no such module, ``run`` makes other than one call into it, or the
cache tensors are not among the arguments exactly once), every layer simply calls ``run``; so
does a layer whose cache strides differ from the first layer's (``run`` can do stride-dependent
work outside the recorded call: the fa3 prefill backend converts the page indices first). Where
``run`` passes the ``(k, v)`` pair itself too (the tensor-core decode path does), the layer's
pair is swapped in as well.

Where the launch is a tvm-ffi function (flashinfer 0.5's compiled modules) and torch has the
DLPack C exchange API (tvm-ffi's no-sync import), the recorded tensors that stay the same for
every layer are converted to tvm-ffi tensors once, when recorded: passing a torch tensor
converts it again on each call. Only the cache tensors stay torch tensors, so each call still
takes the device and the stream from them, as tvm-ffi does for torch arguments. Measured on an
H200 host (SmolLM2-135M heads, 16 tokens, fa2: 27 arguments, of which 9 are such tensors and
the plan info is already a tvm-ffi Array): 8.20 -> 5.93 us per call (best of 5 x 2,000 calls of
the recorded launch), the same output bit for bit; the whole 16-token forward 0.952 -> 0.908 ms
(4 alternating rounds of 500 in one process). With ``TVM_FFI_SKIP_DLPACK_C_EXCHANGE_API=1``
(tvm-ffi's own switch off that import) nothing is converted.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

#: Name of the closure cell of flashinfer's Python ``paged_run`` that holds the compiled function.
COMPILED_CELL = "paged_run_func"


class _InnerCalls:
    """While entered, the calls a Python function ``fn`` makes, on the entering thread, through
    its closure cell named :data:`COMPILED_CELL` are recorded: ``[args]`` per positional call,
    None for a call with keywords. ``target`` is that cell's callable (None where ``fn`` has no
    such cell, the cell is empty or another recording holds it; nothing is recorded then)."""

    def __init__(self, fn: Any) -> None:
        self.calls: list[list[Any] | None] = []
        self.target: Callable[..., Any] | None = None
        self._cell = None
        self._recorder = self._record  # one bound method, so that __exit__ can tell it by `is`
        self._thread = threading.get_ident()
        code, closure = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
        if code is None or not closure or COMPILED_CELL not in code.co_freevars:
            return
        cell = closure[code.co_freevars.index(COMPILED_CELL)]
        try:
            target = cell.cell_contents
        except ValueError:  # an empty cell
            return
        if callable(target) and not isinstance(getattr(target, "__self__", None), _InnerCalls):
            self._cell, self.target = cell, target

    def _record(self, *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == self._thread:
            self.calls.append(None if kwargs else list(args))
        return self.target(*args, **kwargs)

    def __enter__(self) -> _InnerCalls:
        if self._cell is not None:
            self._cell.cell_contents = self._recorder
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._cell is not None and self._cell.cell_contents is self._recorder:
            self._cell.cell_contents = self.target
        # The bound method refers back to self: dropped, no cycle keeps the recorded arguments
        # (a layer's cache views) alive until the next garbage collection.
        self._recorder = None


class _CallRecorder:
    """Stands in for a wrapper's compiled module during one ``run``: forwards every call and
    records ``(function, args, inner)`` of the calls made (``inner``: :class:`_InnerCalls`)."""

    def __init__(self, module: Any) -> None:
        self._module = module
        self.calls: list[tuple[Callable[..., Any], list[Any] | None, _InnerCalls]] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._module, name)
        if not callable(attr):
            return attr

        def record(*args: Any, **kwargs: Any) -> Any:
            inner = _InnerCalls(attr)
            # keyword calls are not replayed: None marks the recording unusable
            self.calls.append((attr, None if kwargs else list(args), inner))
            with inner:
                return attr(*args, **kwargs)

        return record


class LayerAttention:
    """One step's attention for each layer: ``attend((k_cache, v_cache))`` writes
    ``wrapper.run(q, (k_cache, v_cache))`` into ``out``.

    The first call goes through ``run`` and records its kernel call; later calls replay that call
    on their layer's cache (module docstring). A cache given as one 5-D tensor (not the bound
    ``(k, v)`` views) always goes through ``run``.

    Args:
        wrapper: a flashinfer wrapper planned for this step (prefill or decode).
        q: ``[n, num_heads, head_dim]``; out: the same shape, written in place.
    """

    def __init__(self, wrapper: Any, q: torch.Tensor, out: torch.Tensor) -> None:
        self.wrapper = wrapper
        self.q = q
        self.out = out
        self._launch: Callable[..., Any] | None = None
        self._args: list[Any] | None = None
        self._slots: tuple[int, int] = (-1, -1)
        self._pair_slots: list[int] = []  # where the (k, v) tuple itself was passed
        self._strides: tuple = ()
        self._recorded = False

    def __call__(
        self,
        kv: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        strides: tuple | None = None,
    ) -> None:
        """Attend over ``kv``; ``strides``: ``(kv[0].stride(), kv[1].stride())`` where the
        caller knows them (the backend keeps them with its bound views), else read here."""
        if (
            self._args is not None
            and isinstance(kv, tuple)
            and (strides or (kv[0].stride(), kv[1].stride())) == self._strides
        ):
            args = self._args
            args[self._slots[0]], args[self._slots[1]] = kv
            for i in self._pair_slots:
                args[i] = kv
            self._launch(*args)
        elif self._recorded or not isinstance(kv, tuple):
            self.wrapper.run(self.q, kv, out=self.out)
        else:
            self._record(kv)

    def _record(self, kv: tuple[torch.Tensor, torch.Tensor]) -> None:
        """``run`` once, through a recorder standing in for the wrapper's compiled module."""
        self._recorded = True
        module = getattr(self.wrapper, "_cached_module", None)
        if module is None:
            self.wrapper.run(self.q, kv, out=self.out)
            return
        recorder = _CallRecorder(module)
        self.wrapper._cached_module = recorder
        try:
            self.wrapper.run(self.q, kv, out=self.out)
        finally:
            self.wrapper._cached_module = module
        if len(recorder.calls) != 1 or recorder.calls[0][1] is None:
            return
        launch, args, inner = recorder.calls[0]
        slots = _cache_slots(args, kv)
        if len(inner.calls) == 1 and inner.calls[0] is not None:
            inner_slots = _cache_slots(inner.calls[0], kv)
            if inner_slots is not None:  # the compiled function under the Python method
                launch, args, slots = inner.target, inner.calls[0], inner_slots
        if slots is not None:
            self._pair_slots = [i for i, a in enumerate(args) if a is kv]
            self._launch, self._slots = launch, slots
            self._args = _preconverted(launch, args, {*slots, *self._pair_slots})
            # Work run() does outside the recorded call (fa3's index conversion) depends on
            # the cache strides: a layer whose cache is laid out differently goes through run().
            self._strides = (kv[0].stride(), kv[1].stride())


def _ffi_tensor_import(launch: Any) -> Callable[[torch.Tensor], Any] | None:
    """tvm-ffi's ``from_dlpack`` where ``launch`` is a tvm-ffi function and torch tensors import
    through the DLPack C exchange API (no stream sync; what tvm-ffi does with a torch argument
    on every call), else None. Should that API refuse a tensor, ``from_dlpack`` falls back to
    torch's ``__dlpack__()``, which makes the default stream wait on the current one through an
    event: once per step and tensor, never a host sync."""
    ffi = sys.modules.get("tvm_ffi")
    function = getattr(ffi, "Function", None)
    if function is None or not isinstance(launch, function):
        return None
    if not hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
        return None
    if os.environ.get("TVM_FFI_SKIP_DLPACK_C_EXCHANGE_API", "0") == "1":
        return None  # tvm-ffi then converts torch arguments another way; so does this call
    return ffi.from_dlpack


def _preconverted(launch: Any, args: list[Any], keep: set[int]) -> list[Any]:
    """``args`` with every torch tensor outside the positions ``keep`` converted once for
    ``launch`` (:func:`_ffi_tensor_import`); ``args`` itself where there is no such conversion
    or one fails (the call then converts them itself, as before)."""
    convert = _ffi_tensor_import(launch)
    if convert is None:
        return args
    try:
        return [
            convert(a) if i not in keep and isinstance(a, torch.Tensor) else a
            for i, a in enumerate(args)
        ]
    except Exception:  # noqa: BLE001 - any failure: the call converts them, as before
        return args


def _cache_slots(args: list[Any], kv: tuple[torch.Tensor, torch.Tensor]) -> tuple[int, int] | None:
    """The positions of the k and the v cache in ``args`` where each is there exactly once (by
    identity), else None."""
    k_at = [i for i, a in enumerate(args) if a is kv[0]]
    v_at = [i for i, a in enumerate(args) if a is kv[1]]
    return (k_at[0], v_at[0]) if len(k_at) == 1 and len(v_at) == 1 else None
