"""Tensor parallelism: process groups, collectives, the step broadcast from rank 0, and the rank
processes' launcher (``torch.distributed``: NCCL on CUDA, gloo on CPU). Also the KV-cache events
that leave the engine for fleet routers: their wire format (``kv_events``) and publishers
(``kv_event_publisher``)."""
