"""``n > 1``: one request's ``n`` choices as ``n`` engine requests, each prompt prefilled once.

One engine request is one sequence, so a front end (the server's ``entrypoints.openai.choices``,
the offline ``LLM``) fans ``SamplingParams(n=...)`` out into ``n`` requests with
:func:`choice_params`, and admits them in this order: choice 0 of a prompt first,
its ``n - 1`` siblings once choice 0's first output arrived. The engine caches a full KV block
in the prefix cache only after a step wrote it, so siblings admitted in the same step would each
prefill the whole prompt; admitted after choice 0's first token they find every full block of the
prompt in the prefix cache and compute only its last partial block (prefix-cache hits grow by
``(n - 1) x`` the prompt's whole-block tokens). vLLM v1 fans out the same way
(vllm/v1/engine/parallel_sampling.py, ``ParentRequest``), without the wait for the first token.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fastdeploy.core.sampling_params import SamplingParams

#: Choice seeds wrap at the range of a generator's seed (``SamplingParams.seed < 2**64``).
SEED_MODULUS = 2**64


def choice_params(params: SamplingParams, j: int) -> SamplingParams:
    """The sampling parameters of choice ``j`` (0-based, ``j < params.n`` where ``n > 1``): the
    request's with ``n=1``; with ``seed + j`` (mod :data:`SEED_MODULUS`) for a seeded request
    (vLLM's rule, vllm/v1/engine/parallel_sampling.py ``ParentRequest``: choice 0 keeps the seed,
    so ``n=1`` samples as before); and without ``prompt_logprobs`` for ``j > 0``: a request asking
    for them never reads the prefix cache (it would prefill the prompt again), and they are the
    same for every choice (choice 0 carries them). ``params`` itself for choice 0 of ``n=1``.

    Raises:
        ValueError: ``j`` is not an integer in ``[0, max(n, ...))``; ``j >= n`` is allowed only for
            ``n == 1`` (the server keeps ``n`` off the engine's params and numbers choices itself).
    """
    if not isinstance(j, int) or j < 0 or (params.n > 1 and j >= params.n):
        raise ValueError(f"choice j={j!r} is invalid; allowed: an integer in [0, {params.n})")
    if j == 0 and params.n == 1:
        return params
    changes: dict[str, Any] = {"n": 1}
    if j > 0:
        changes["prompt_logprobs"] = None
        if params.seed is not None:
            changes["seed"] = (params.seed + j) % SEED_MODULUS
    return dataclasses.replace(params, **changes)
