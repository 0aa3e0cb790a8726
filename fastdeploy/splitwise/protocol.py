"""vLLM's ``kv_transfer_params`` as the two PD roles speak it (``docs/pd-disaggregation.md``).

* In a prefill-leg request: ``{"do_remote_decode": true}``.
* In the prefill node's answer, and so in the decode-leg request: :class:`RemotePrefill` as a dict
  (where the blocks are, the first token, the lease, the transport's metadata, the layout).

The decode node compares the layout fingerprint with its own and refuses a mismatch with a 400
that names the differing fields, before it touches a block. It also compares ``prompt_hash`` (the
prompt fingerprint, :func:`prompt_fingerprint`) with the prompt it was sent: a reference to another
prompt's KV is refused, since pulling it would cache that KV under this prompt's block hashes.
``prompt_hash`` is a field we add to vLLM's params; routers pass it through like the others.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: Fields of the layout fingerprint: both engines must agree on every one.
LAYOUT_FIELDS = (
    "model",
    "dtype",
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "block_size",
    "tp_size",
)


def kv_layout(
    model: str,
    dtype: str,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    tp_size: int = 1,
) -> dict[str, Any]:
    """The layout fingerprint of one engine's KV cache (JSON-able)."""
    values = (model, dtype, num_layers, num_kv_heads, head_dim, block_size, tp_size)
    return dict(zip(LAYOUT_FIELDS, values))


#: What a prompt fingerprint looks like: the hash's name, then its hex digest.
PROMPT_HASH_FORMAT = re.compile(r"^sha256:[0-9a-f]{64}$")


def prompt_fingerprint(token_ids: Sequence[int]) -> str:
    """The fingerprint of a prompt that ``kv_transfer_params.prompt_hash`` carries:
    ``"sha256:"`` and the hex SHA-256 of the token ids as little-endian signed 64-bit integers.

    Both legs compute it from the token ids they received, so it ties a KV reference to its
    prompt whatever the tokenizer or the router did to the text.

    Raises:
        OverflowError: a token id outside the signed 64-bit range (admission refuses those
            before, as outside the vocabulary).
    """
    data = array("q", token_ids)
    if sys.byteorder == "big":
        data.byteswap()
    return "sha256:" + hashlib.sha256(data.tobytes()).hexdigest()


def is_prefill_leg(params: Any) -> bool:
    """The request asks this (prefill) node to keep its KV for a decode node."""
    return isinstance(params, dict) and params.get("do_remote_decode") is True


@dataclass(frozen=True)
class RemotePrefill:
    """What a prefill node answers, and what a decode node needs to continue the request.

    Attributes:
        remote_engine_id: the prefill engine's id.
        remote_request_id: its request id (CLAIM/DONE/ABORT name it).
        remote_host, remote_port: its side channel.
        remote_block_ids: its block table for the prompt (full and partial blocks).
        num_prompt_tokens: prompt tokens whose KV the blocks hold.
        first_token_id: the token it sampled after the prompt.
        lease_s: seconds the blocks are held unclaimed.
        transport: the transport's metadata (``{"transport": "tcp" | "nixl", ...}``).
        layout: the fingerprint (:func:`kv_layout`).
        first_token_logprobs: the first token's logprobs entry when the request asked for
            logprobs (``[{"token_id", "logprob", "top_logprobs"}]``), else None.
        prompt_hash: :func:`prompt_fingerprint` of the prompt the blocks hold (required in a
            decode leg; None only in objects built by hand, in tests).
    """

    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    remote_block_ids: list[int]
    num_prompt_tokens: int
    first_token_id: int
    lease_s: float
    transport: dict[str, Any]
    layout: dict[str, Any]
    first_token_logprobs: list[dict[str, Any]] | None = None
    prompt_hash: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_params(cls, params: Any, local_layout: dict[str, Any]) -> RemotePrefill:
        """Validate a decode-leg ``kv_transfer_params`` against this node's layout.

        Raises:
            ValueError: not an object, a missing or mistyped field, or a layout mismatch; the
                message names the fields (a 400 for the client).
        """
        if not isinstance(params, dict):
            raise ValueError(f"kv_transfer_params={params!r} is invalid; allowed: an object")
        types = {
            "remote_engine_id": str,
            "remote_request_id": str,
            "remote_host": str,
            "remote_port": int,
            "remote_block_ids": list,
            "num_prompt_tokens": int,
            "first_token_id": int,
            "lease_s": (int, float),
            "transport": dict,
            "layout": dict,
            "prompt_hash": str,
        }
        bad = [
            k
            for k, t in types.items()
            if not isinstance(params.get(k), t) or isinstance(params.get(k), bool)
        ]
        if bad:
            raise ValueError(
                f"kv_transfer_params is missing or mistypes {', '.join(bad)} (is the router "
                "passing the prefill node's answer through unchanged?)"
            )
        if not PROMPT_HASH_FORMAT.match(params["prompt_hash"]):
            raise ValueError(
                f"kv_transfer_params.prompt_hash={params['prompt_hash'][:80]!r} is invalid; "
                "allowed: 'sha256:' and 64 lowercase hex digits (the prefill node's fingerprint "
                "of the prompt)"
            )
        if not all(isinstance(b, int) and b > 0 for b in params["remote_block_ids"]):
            raise ValueError("kv_transfer_params.remote_block_ids must be block ids > 0")
        diff = [
            f"{k}: prefill {params['layout'].get(k)!r} != decode {local_layout.get(k)!r}"
            for k in LAYOUT_FIELDS
            if params["layout"].get(k) != local_layout.get(k)
        ]
        if diff:
            raise ValueError("the prefill node's KV layout differs: " + "; ".join(diff))
        logprobs = params.get("first_token_logprobs")
        if logprobs is not None and not isinstance(logprobs, list):
            raise ValueError("kv_transfer_params.first_token_logprobs must be a list or null")
        return cls(**{k: params[k] for k in types}, first_token_logprobs=logprobs)
