"""Dynamo's token-in request to our :class:`SamplingParams`, and our outputs to Dynamo's
token-out chunks.

The shapes are Dynamo 1.6's ``PreprocessedRequest`` and ``LLMEngineOutput`` as its Python backend
contract documents them (``dynamo.common.backend.engine.GenerateRequest`` / ``GenerateChunk``):
a request is ``{"token_ids": [int], "sampling_options": {...}, "stop_conditions": {...},
"output_options": {...}, ...}``; a chunk is ``{"token_ids": [new ids], "index": 0}`` with, on the
last one, ``"finish_reason"`` and ``"completion_usage"``.
"""

from __future__ import annotations

from typing import Any

from fastdeploy.core.sampling_params import SamplingParams

#: sampling_options keys copied as they are (the same name and meaning as ours and vLLM's).
_SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
#: stop_conditions keys copied as they are.
_STOP_KEYS = ("min_tokens", "ignore_eos")
#: Our finish reasons -> Dynamo's (``abort`` is Dynamo's ``cancelled``; Dynamo 1.6
#: ``common/utils/engine_response.normalize_finish_reason`` maps vLLM's the same way).
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "cancelled"}


def _unsupported(name: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{name}={value!r} is not supported by this worker; allowed: {allowed}")


def to_sampling_params(request: dict, max_model_len: int) -> tuple[list[int], SamplingParams]:
    """``(prompt_token_ids, sampling_params)`` of a Dynamo request.

    Args:
        request: Dynamo's preprocessed request (a dict).
        max_model_len: the engine's context length (tokens); without ``max_tokens`` a request
            may generate up to it, as vLLM's Dynamo backend does.

    Stop strings go to our engine too (it stops and frees the request's KV blocks in the same
    step); Dynamo's detokenizer applies them again to the text. ``stop_token_ids_hidden`` (the
    model's extra stop tokens Dynamo knows of) join ``stop_token_ids``.

    Raises:
        ValueError: no ``token_ids``, a field we cannot honour (``n`` > 1, beam search,
            ``min_p``, guided decoding, prompt logprobs), or a value our ``SamplingParams``
            refuses; each names the field, the value and what is allowed.
    """
    token_ids = request.get("token_ids")
    if not isinstance(token_ids, list) or not token_ids:
        raise ValueError(f"token_ids={token_ids!r} is invalid; allowed: a non-empty list of ints")
    sampling = request.get("sampling_options") or {}
    stops = request.get("stop_conditions") or {}
    output = request.get("output_options") or {}
    kwargs: dict[str, Any] = {k: sampling[k] for k in _SAMPLING_KEYS if sampling.get(k) is not None}
    kwargs.update({k: stops[k] for k in _STOP_KEYS if stops.get(k) is not None})
    if sampling.get("n") not in (None, 1):
        raise _unsupported("n", sampling["n"], "1")
    if sampling.get("use_beam_search"):
        raise _unsupported("use_beam_search", True, "false")
    if sampling.get("min_p") not in (None, 0, 0.0):
        raise _unsupported("min_p", sampling["min_p"], "0 or null")
    if sampling.get("guided_decoding") is not None:
        raise _unsupported("guided_decoding", sampling["guided_decoding"], "null")
    if output.get("prompt_logprobs") is not None:
        raise _unsupported("prompt_logprobs", output["prompt_logprobs"], "null")
    if output.get("logprobs") is not None:
        kwargs["logprobs"] = int(output["logprobs"])
    if output.get("skip_special_tokens") is not None:
        kwargs["skip_special_tokens"] = bool(output["skip_special_tokens"])
    stop = stops.get("stop")
    if stop:
        kwargs["stop"] = [stop] if isinstance(stop, str) else list(stop)
    hidden = stops.get("stop_token_ids_hidden")
    if hidden:
        kwargs["stop_token_ids"] = sorted(set(hidden))
    max_tokens = stops.get("max_tokens")
    kwargs["max_tokens"] = (
        max_tokens if max_tokens is not None else max(1, max_model_len - len(token_ids))
    )
    return token_ids, SamplingParams(**kwargs)


def _logprob_fields(delta_logprobs: list[dict] | None) -> dict[str, Any]:
    """Dynamo's ``log_probs`` (the sampled token's, per new token) and ``top_logprobs`` (per new
    token, ``[{"rank", "token_id", "token", "logprob"}]``; ``token`` is None: Dynamo's
    detokenizer fills the text) from our per-token ``{"token_id", "logprob", "top_logprobs":
    [(id, lp)]}``."""
    if not delta_logprobs:
        return {}
    return {
        "log_probs": [float(lp["logprob"]) for lp in delta_logprobs],
        "top_logprobs": [
            [
                {"rank": rank, "token_id": int(tid), "token": None, "logprob": float(value)}
                for rank, (tid, value) in enumerate(lp.get("top_logprobs") or (), start=1)
            ]
            for lp in delta_logprobs
        ],
    }


def to_chunk(output: Any) -> dict[str, Any]:
    """Dynamo's chunk for one of our ``RequestOutput`` updates: the new token ids (and their
    logprobs when asked); on the finished update also ``finish_reason`` (``stop``, ``length`` or
    ``cancelled``) and ``completion_usage`` (``prompt_tokens``, ``completion_tokens``,
    ``total_tokens``, ``prompt_tokens_details.cached_tokens``: the prompt tokens our prefix cache
    served)."""
    seq = output.outputs[0]
    chunk: dict[str, Any] = {"token_ids": list(seq.delta_token_ids or ()), "index": 0}
    chunk.update(_logprob_fields(seq.delta_logprobs))
    if output.finished:
        chunk["finish_reason"] = FINISH_REASONS.get(seq.finish_reason, "stop")
        prompt, completion = len(output.prompt_token_ids), len(seq.token_ids)
        chunk["completion_usage"] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens},
        }
    return chunk


def error_chunk(message: str) -> dict[str, Any]:
    """The last chunk of a request that failed: no tokens, ``finish_reason`` ``error: ...``
    (the form Dynamo's own vLLM backend uses for an engine error)."""
    return {"token_ids": [], "index": 0, "finish_reason": f"error: {message}"}
