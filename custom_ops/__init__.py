"""The project's own kernels, where no library has one (Triton first).

Each kernel has a torch reference that is used on CPU and in the tests.
"""
