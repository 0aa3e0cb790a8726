"""A request's PD legs at the edge of a node: the admission checks of ``kv_transfer_params``
(:func:`check_kv_transfer_params`, :func:`check_decode_leg`), and the ABORT a decode node sends a
prefill node whose blocks will not be pulled (:func:`send_abort`, :func:`release_refused_leg`).
Moved out of :mod:`fastdeploy.splitwise.roles`, which re-exports them."""

from __future__ import annotations

import logging
import threading
from typing import Any

from fastdeploy.splitwise.pd_auth import PDAuth, PrefillTrust
from fastdeploy.splitwise.protocol import RemotePrefill, is_prefill_leg, prompt_fingerprint
from fastdeploy.splitwise.side_channel import PROCESS_AUTH, SideChannelError, send_control

logger = logging.getLogger("fastdeploy.splitwise.roles")


def check_first_token_logprobs(entries, token_id: int) -> None:
    """A decode leg's ``first_token_logprobs``: None, or one ``{"token_id", "logprob",
    "top_logprobs": [[id, logprob], ...]}`` entry for ``token_id``.

    Raises:
        ValueError: any other shape, naming the field.
    """
    if entries is None:
        return
    ok = isinstance(entries, list) and len(entries) == 1 and isinstance(entries[0], dict)
    if ok:
        e = entries[0]
        top = e.get("top_logprobs")
        ok = (
            e.get("token_id") == token_id
            and isinstance(e.get("logprob"), (int, float))
            and isinstance(top, list)
            and all(
                isinstance(t, (list, tuple))
                and len(t) == 2
                and isinstance(t[0], int)
                and isinstance(t[1], (int, float))
                for t in top
            )
        )
    if not ok:
        raise ValueError(
            "kv_transfer_params.first_token_logprobs is invalid; allowed: null or the prefill "
            "node's one entry for first_token_id"
        )


def check_decode_leg(
    leg: Any, prompt_token_ids: list[int], vocab_size: int, block_size: int
) -> None:
    """A decode leg's :class:`RemotePrefill` against the request it arrived with: the same
    prompt (length, then fingerprint: a reference of the right length to another prompt's KV
    would be pulled and cached under this prompt's block hashes), a first token inside the
    vocabulary with well-formed logprobs, and one remote block per ``block_size`` prompt tokens.

    Raises:
        ValueError: the first field that does not fit, named with what is allowed.
    """
    n = len(prompt_token_ids)
    if leg.num_prompt_tokens != n:
        raise ValueError(
            f"kv_transfer_params.num_prompt_tokens={leg.num_prompt_tokens} is invalid; "
            f"allowed: this request's {n} prompt tokens (same prompt on both legs)"
        )
    own = prompt_fingerprint(prompt_token_ids)
    if leg.prompt_hash != own:
        raise ValueError(
            f"kv_transfer_params.prompt_hash={leg.prompt_hash!r} is invalid: the KV reference "
            f"belongs to another prompt; allowed: this request's prompt fingerprint {own!r} "
            "(send the decode leg the same prompt token ids as the prefill leg)"
        )
    if not 0 <= leg.first_token_id < vocab_size:
        raise ValueError(
            f"kv_transfer_params.first_token_id={leg.first_token_id} is invalid; "
            f"allowed: a token id in [0, {vocab_size})"
        )
    check_first_token_logprobs(leg.first_token_logprobs, leg.first_token_id)
    if len(leg.remote_block_ids) != -(-n // block_size):
        raise ValueError(
            f"kv_transfer_params.remote_block_ids has {len(leg.remote_block_ids)} "
            f"blocks; allowed: the {n} prompt tokens' blocks"
        )


def send_abort(
    host: str,
    port: int,
    remote_request_id: str,
    unclaimed_only: bool = False,
    auth: PDAuth | None | object = PROCESS_AUTH,
) -> None:
    """Tell a prefill node, from a short-lived thread, that the blocks it holds for
    ``remote_request_id`` are not needed (ABORT on its side channel, signed with ``auth``: by
    default the process's :func:`~fastdeploy.splitwise.pd_auth.process_auth`; with
    ``unclaimed_only`` only if no decode node has claimed them); a failure is logged, since the
    node frees them at lease expiry anyway."""
    extra = {"unclaimed_only": True} if unclaimed_only else {}

    def send() -> None:
        try:
            send_control(host, port, "ABORT", [remote_request_id], auth=auth, **extra)
        except SideChannelError as e:
            logger.warning("ABORT of %s failed: %s", remote_request_id, e)

    threading.Thread(target=send, name="pd-abort", daemon=True).start()


def release_refused_leg(params: Any, trust: PrefillTrust | None) -> bool:
    """A decode node refused a decode leg before admitting it (any 4xx or 503 of the request):
    free the prefill node's blocks for it now rather than at lease expiry, since no decode node
    will pull them (routers do not retry a decode leg).

    Only a prefill node this decode node trusts is told (``trust``:
    :class:`~fastdeploy.splitwise.pd_auth.PrefillTrust`, the admission's; None: the default,
    loopback only): otherwise a client could make the node connect to any address it names,
    which admission refuses for the pull too. Past that check only the three fields that
    address the ABORT are read (``remote_host``, ``remote_port``, ``remote_request_id``), so a
    leg refused for any other field still releases. The ABORT is ``unclaimed_only``: a copy of
    these params admitted elsewhere, whose pull claimed the blocks and may be reading them,
    keeps them. One for an entry already gone is a no-op.

    Returns whether an ABORT was started (False: ``params`` name no prefill node, or one this
    node does not trust).
    """
    if not isinstance(params, dict):
        return False
    host = params.get("remote_host")
    port = params.get("remote_port")
    rid = params.get("remote_request_id")
    addressed = (
        isinstance(host, str)
        and host != ""
        and type(port) is int
        and 0 < port < 65536
        and isinstance(rid, str)
        and rid != ""
    )
    if not addressed:
        return False
    trust = trust or PrefillTrust()
    try:
        trust.check(params)
    except ValueError as e:
        logger.warning("decode leg refused; no ABORT to %s:%s: %s", host, port, e)
        return False
    logger.info("decode leg refused: ABORT of %s to the prefill node %s:%d", rid, host, port)
    # Signed with the secret the trust holds: the server process of a decode node (the engine
    # in a process of its own) has no process-wide PD auth.
    auth = PDAuth(trust.key) if trust.key is not None else PROCESS_AUTH
    send_abort(host, port, rid, unclaimed_only=True, auth=auth)
    return True


def check_kv_transfer_params(role: str, params: Any, layout: dict[str, Any]) -> Any:
    """Admission check of a request's ``kv_transfer_params`` on a node of ``role``.

    Returns None (a plain request), ``True`` for a prefill leg, or the decode leg's
    :class:`RemotePrefill`.

    Raises:
        ValueError: params that are not an object; a prefill leg sent to a node that is not a
            prefill node; a decode leg sent to a node that is not a decode node, or whose fields
            or layout fingerprint are wrong (the message names them).
    """
    if params is None or params == {}:
        return None
    if not isinstance(params, dict):
        raise ValueError(f"kv_transfer_params={params!r} is invalid; allowed: an object or null")
    if is_prefill_leg(params):
        if role != "prefill":
            raise ValueError(
                f"kv_transfer_params.do_remote_decode=true is invalid on a {role} node; allowed: "
                "only on a node started with --splitwise-role prefill"
            )
        return True
    if "remote_block_ids" in params or "remote_engine_id" in params:
        if role != "decode":
            raise ValueError(
                f"kv_transfer_params from a prefill node are invalid on a {role} node; allowed: "
                "only on a node started with --splitwise-role decode"
            )
        return RemotePrefill.from_params(params, layout)
    raise ValueError(
        f"kv_transfer_params={params!r} is invalid; allowed: null, "
        '{"do_remote_decode": true} (prefill leg) or a prefill node\'s answer (decode leg)'
    )
