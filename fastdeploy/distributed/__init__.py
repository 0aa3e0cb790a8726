"""Tensor parallelism: process groups, collectives, the step broadcast from rank 0, and the rank
processes' launcher (``torch.distributed``: NCCL on CUDA, gloo on CPU)."""
