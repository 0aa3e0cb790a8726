"""Errors that end one request on the engine side and that front ends map to an HTTP status."""

from __future__ import annotations


class KVTransferError(RuntimeError):
    """A decode node could not pull a request's KV from its prefill node (the claim was refused,
    the transport failed or timed out) and ``kv_load_failure_policy`` is ``fail``. The server
    answers 502 ``kv_transfer_failed``; the message says which step failed."""


class KVWaitTimeoutError(RuntimeError):
    """A decode-leg request waited longer than ``pd_decode_wait_timeout`` for free KV blocks.
    The server answers 503."""
