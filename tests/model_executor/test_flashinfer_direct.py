"""LayerAttention (the direct flashinfer launch for the layers after a step's first) with a fake
wrapper on CPU: the first layer goes through ``run`` and every later layer replays the recorded
kernel call with its own cache swapped in; anything unexpected falls back to ``run`` per layer.
The real wrapper is compared on the GPU (tests/gpu/test_cuda_graphs_gpu.py: piecewise replay
against the eager forward)."""

import sys
import threading
from types import SimpleNamespace

import pytest
import torch

from fastdeploy.model_executor.layers.attention import flashinfer_direct as fd
from fastdeploy.model_executor.layers.attention.flashinfer_direct import LayerAttention, _InnerCalls


class FakeModule:
    def __init__(self):
        self.launches = []

    def paged_run(self, workspace, q, k_cache, v_cache, out, mode):
        self.launches.append((k_cache, v_cache))
        out.copy_(q * k_cache.sum() + v_cache.sum() + mode)


class FakeWrapper:
    """Mimics flashinfer's run(): checks, then one positional call into ``_cached_module``."""

    def __init__(self, module, calls_per_run=1, keyword=False):
        self._cached_module = module
        self.runs = 0
        self.calls_per_run = calls_per_run
        self.keyword = keyword
        self.workspace = torch.zeros(1)

    def run(self, q, kv, out):
        self.runs += 1
        k, v = kv if isinstance(kv, tuple) else kv.unbind(1)
        for _ in range(self.calls_per_run):
            if self.keyword:
                self._cached_module.paged_run(self.workspace, q, k, v, out, mode=1)
            else:
                self._cached_module.paged_run(self.workspace, q, k, v, out, 1)
        return out


def layers(n=4):
    return [(torch.full((2, 3), float(i)), torch.full((2, 3), 10.0 * i)) for i in range(n)]


def expected(q, kv):
    return q * kv[0].sum() + kv[1].sum() + 1


def attend_all(wrapper, caches) -> None:
    """One step's attention over ``caches``, each layer's output checked."""
    q, out = torch.randn(2, 3), torch.empty(2, 3)
    attend = LayerAttention(wrapper, q, out)
    for kv in caches:
        attend(kv)
        torch.testing.assert_close(out, expected(q, kv))


def test_first_layer_runs_then_later_layers_launch_directly():
    module = FakeModule()
    wrapper = FakeWrapper(module)
    caches = layers()
    attend_all(wrapper, caches)
    assert wrapper.runs == 1  # only the first layer went through run()
    # every layer launched the kernel once, on its own cache tensors
    assert [(a is k, b is v) for (a, b), (k, v) in zip(module.launches, caches)] == [(1, 1)] * 4
    assert wrapper._cached_module is module  # the recorder was taken out again


def test_unusual_wrappers_fall_back_to_run_every_layer():
    for wrapper in (
        FakeWrapper(FakeModule(), calls_per_run=2),  # two kernel calls per run
        FakeWrapper(FakeModule(), keyword=True),  # keyword arguments
    ):
        q, out = torch.randn(2, 3), torch.empty(2, 3)
        attend = LayerAttention(wrapper, q, out)
        for kv in layers():
            attend(kv)
            torch.testing.assert_close(out, expected(q, kv))
        assert wrapper.runs == 4


def test_a_cache_tensor_not_split_into_views_goes_through_run():
    wrapper = FakeWrapper(FakeModule())
    q, out = torch.randn(2, 3), torch.empty(2, 3)
    attend = LayerAttention(wrapper, q, out)
    for k, v in layers(3):
        cache = torch.stack((k, v), dim=1)  # one tensor: run() unbinds it into new views
        attend(cache)
        torch.testing.assert_close(out, expected(q, (k, v)))
    assert wrapper.runs == 3


def test_a_wrapper_without_compiled_module_runs_every_layer():
    wrapper = FakeWrapper(FakeModule())
    module = wrapper._cached_module
    del wrapper._cached_module

    def run(q, kv, out):
        wrapper.runs += 1
        module.paged_run(wrapper.workspace, q, kv[0], kv[1], out, 1)

    wrapper.run = run
    q, out = torch.randn(2, 3), torch.empty(2, 3)
    attend = LayerAttention(wrapper, q, out)
    for kv in layers(3):
        attend(kv)
    assert wrapper.runs == 3


def test_a_cache_with_other_strides_goes_through_run():
    wrapper = FakeWrapper(FakeModule())
    q, out = torch.randn(2, 3), torch.empty(2, 3)
    attend = LayerAttention(wrapper, q, out)
    k0, v0 = layers(1)[0]
    attend((k0, v0))
    k1 = torch.full((3, 2), 2.0).t()  # same shape, transposed strides
    attend((k1, v0))
    torch.testing.assert_close(out, expected(q, (k1, v0)))
    assert wrapper.runs == 2


def test_the_pair_itself_is_swapped_where_run_passes_it():
    class PairModule(FakeModule):
        def paged_run(self, workspace, q, k_cache, v_cache, out, mode, pair):
            assert pair[0] is k_cache and pair[1] is v_cache
            super().paged_run(workspace, q, k_cache, v_cache, out, mode)

    class PairWrapper(FakeWrapper):
        def run(self, q, kv, out):
            self.runs += 1
            self._cached_module.paged_run(self.workspace, q, kv[0], kv[1], out, 1, kv)

    wrapper = PairWrapper(PairModule())
    q, out = torch.randn(2, 3), torch.empty(2, 3)
    attend = LayerAttention(wrapper, q, out)
    for kv in layers():
        attend(kv)
        torch.testing.assert_close(out, expected(q, kv))
    assert wrapper.runs == 1


def closure_module(inner_calls_per_call=1, pass_views=False, keyword=False, raises=False):
    """A module whose ``paged_run`` is a Python function around a compiled-like function held
    in a closure cell named ``paged_run_func``, as flashinfer's JIT prefill modules are built."""
    launches, outer_calls = [], []

    def make():
        def compiled(workspace, q, k_cache, v_cache, out, mode):
            if raises:
                raise RuntimeError("kernel failed")
            launches.append((k_cache, v_cache))
            out.copy_(q * k_cache.sum() + v_cache.sum() + mode)

        paged_run_func = compiled

        def paged_run(workspace, q, k_cache, v_cache, out, mode):
            outer_calls.append(1)
            if pass_views:
                k_cache, v_cache = k_cache[:], v_cache[:]
            for _ in range(inner_calls_per_call):
                if keyword:
                    paged_run_func(workspace, q, k_cache, v_cache, out, mode=mode)
                else:
                    paged_run_func(workspace, q, k_cache, v_cache, out, mode)

        return paged_run, compiled

    module = FakeModule()
    module.paged_run, compiled = make()
    return module, launches, outer_calls, compiled


def cell_of(fn, name="paged_run_func"):
    return fn.__closure__[fn.__code__.co_freevars.index(name)]


def test_later_layers_call_the_compiled_function_under_the_python_wrapper():
    module, launches, outer_calls, compiled = closure_module()
    wrapper = FakeWrapper(module)
    caches = layers()
    attend_all(wrapper, caches)
    assert wrapper.runs == 1 and len(outer_calls) == 1  # the Python layer ran for layer 0 only
    assert [(a is k, b is v) for (a, b), (k, v) in zip(launches, caches)] == [(1, 1)] * 4
    assert cell_of(module.paged_run).cell_contents is compiled  # the cell was given back


def test_a_wrapper_whose_inner_calls_differ_keeps_the_python_call():
    for kwargs in ({"inner_calls_per_call": 2}, {"pass_views": True}, {"keyword": True}):
        module, launches, outer_calls, compiled = closure_module(**kwargs)
        wrapper = FakeWrapper(module)
        attend_all(wrapper, layers())
        assert wrapper.runs == 1 and len(outer_calls) == 4, kwargs
        assert cell_of(module.paged_run).cell_contents is compiled


def test_the_cell_is_given_back_when_the_call_raises():
    module, _, _, compiled = closure_module(raises=True)
    attend = LayerAttention(FakeWrapper(module), torch.randn(2, 3), torch.empty(2, 3))
    with pytest.raises(RuntimeError, match="kernel failed"):
        attend(layers(1)[0])
    assert cell_of(module.paged_run).cell_contents is compiled


def test_other_cells_and_empty_cells_keep_the_python_call():
    # A cell of another name (flashinfer's CUDA-core decode module calls it run_func) and an
    # empty cell: nothing is recorded below the module method.
    def make(name_is_run_func: bool):
        def compiled(*args):
            return None

        if name_is_run_func:
            run_func = compiled

            def paged_run(*args):
                run_func(*args)
        else:

            def paged_run(*args):
                paged_run_func(*args)  # noqa: F821 - assigned after, never bound: empty cell

            paged_run_func = None  # noqa: F841
            del paged_run_func

        return paged_run

    for fn in (make(True), make(False)):
        inner = _InnerCalls(fn)
        with inner:
            pass
        assert inner.target is None and inner.calls == []


def test_overlapping_recordings_and_other_threads_record_nothing_foreign():
    module, _, _, compiled = closure_module()
    fn = module.paged_run
    a = _InnerCalls(fn)
    with a:
        b = _InnerCalls(fn)  # a second recording while one is active does not start
        assert b.target is None
        seen = []
        t = threading.Thread(target=lambda: seen.append(fn(1, torch.ones(1), *(torch.ones(1),) * 2,
                                                            torch.empty(1), 0)))  # fmt: skip
        t.start()
        t.join()
        assert a.calls == []  # the other thread's call went straight through
        fn(1, torch.ones(1), torch.ones(1), torch.ones(1), torch.empty(1), 0)
        assert len(a.calls) == 1
    assert cell_of(fn).cell_contents is compiled


class Converted:
    """What a fake tvm-ffi import makes of a torch tensor."""

    def __init__(self, t):
        self.t = t


def unwrap(a):
    return a.t if isinstance(a, Converted) else a


def converting_module():
    """closure_module's shape, its compiled function taking converted tensors as tvm-ffi's does."""
    seen = []

    def compiled(workspace, q, k_cache, v_cache, out, mode):
        seen.append((workspace, q, k_cache, v_cache, out))
        out_t = unwrap(out)
        out_t.copy_(unwrap(q) * k_cache.sum() + v_cache.sum() + mode)

    paged_run_func = compiled

    def paged_run(workspace, q, k_cache, v_cache, out, mode):
        paged_run_func(workspace, q, k_cache, v_cache, out, mode)

    module = FakeModule()
    module.paged_run = paged_run
    return module, compiled, seen


def test_tensors_every_layer_shares_are_converted_once_and_the_caches_never(monkeypatch):
    module, compiled, seen = converting_module()
    conversions = []

    def importer(launch):
        if launch is not compiled:
            return None

        def convert(t):
            conversions.append(t)
            return Converted(t)

        return convert

    monkeypatch.setattr(fd, "_ffi_tensor_import", importer)
    wrapper = FakeWrapper(module)
    caches = layers()
    attend_all(wrapper, caches)
    assert wrapper.runs == 1
    # layer 0 went through run() with torch tensors; layers 1.. got workspace, q and out
    # converted (three conversions in all, made once), and their own cache tensors as they are
    assert len(conversions) == 3
    for (ws, q, k, v, out), (ck, cv) in zip(seen[1:], caches[1:]):
        assert all(isinstance(a, Converted) for a in (ws, q, out))
        assert k is ck and v is cv


def test_a_failed_conversion_keeps_the_torch_arguments(monkeypatch):
    module, compiled, seen = converting_module()

    def convert(t):
        raise BufferError("no DLPack")

    monkeypatch.setattr(fd, "_ffi_tensor_import", lambda launch: convert)
    wrapper = FakeWrapper(module)
    attend_all(wrapper, layers())
    assert wrapper.runs == 1
    assert all(isinstance(a, torch.Tensor) for call in seen for a in call)


def test_strides_given_by_the_caller_decide_the_direct_launch():
    wrapper = FakeWrapper(FakeModule())
    q, out = torch.randn(2, 3), torch.empty(2, 3)
    attend = LayerAttention(wrapper, q, out)
    kv = layers(1)[0]
    strides = (kv[0].stride(), kv[1].stride())
    attend(kv, strides)
    attend(kv, strides)  # the known strides: direct
    assert wrapper.runs == 1
    attend(kv, ((9, 9), (9, 9)))  # strides said to differ: through run()
    assert wrapper.runs == 2
    torch.testing.assert_close(out, expected(q, kv))


def test_only_a_tvm_ffi_function_with_the_exchange_api_gets_the_import(monkeypatch):
    class Function:  # stands in for tvm_ffi.Function
        def __call__(self, *args):
            return None

    def from_dlpack(t):
        return Converted(t)

    monkeypatch.delenv("TVM_FFI_SKIP_DLPACK_C_EXCHANGE_API", raising=False)
    fake_ffi = SimpleNamespace(Function=Function, from_dlpack=from_dlpack)
    monkeypatch.setitem(sys.modules, "tvm_ffi", fake_ffi)
    monkeypatch.setattr(torch.Tensor, "__dlpack_c_exchange_api__", object(), raising=False)
    assert fd._ffi_tensor_import(Function()) is from_dlpack
    assert fd._ffi_tensor_import(lambda *a: None) is None  # a Python launch: never converted
    monkeypatch.setenv("TVM_FFI_SKIP_DLPACK_C_EXCHANGE_API", "1")  # tvm-ffi's switch
    assert fd._ffi_tensor_import(Function()) is None
    monkeypatch.delenv("TVM_FFI_SKIP_DLPACK_C_EXCHANGE_API")
    monkeypatch.delattr(torch.Tensor, "__dlpack_c_exchange_api__")  # no no-sync import
    assert fd._ffi_tensor_import(Function()) is None
    monkeypatch.delitem(sys.modules, "tvm_ffi")  # no tvm-ffi at all
    assert fd._ffi_tensor_import(Function()) is None


def test_a_recording_leaves_no_reference_cycle():
    import gc
    import weakref

    module, _, seen = converting_module()
    wrapper = FakeWrapper(module)
    q, out = torch.randn(2, 3), torch.empty(2, 3)
    k, v = torch.ones(2, 3), torch.ones(2, 3)
    attend = LayerAttention(wrapper, q, out)
    attend((k, v))
    ref = weakref.ref(k)
    seen.clear()  # the fake kernel's own record of its arguments
    gc.disable()
    try:
        del attend, k, v
        assert ref() is None  # freed by reference counting alone, without the cycle collector
    finally:
        gc.enable()
