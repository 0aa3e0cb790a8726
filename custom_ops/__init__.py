"""The project's own kernels, where no library has one (Triton first).

Each kernel has a torch reference that is used on CPU and in the tests.
"""

from custom_ops.kv_cache_ops import write_kv_cache, write_kv_cache_torch, write_kv_cache_triton

__all__ = ["write_kv_cache", "write_kv_cache_torch", "write_kv_cache_triton"]
