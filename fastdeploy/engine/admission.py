"""The admission check every front end runs before it queues a request.

It reads only what the engine fixed at start-up, so it runs wherever the request arrives: on the
engine's own thread, on the server's asyncio thread, or in the server process while the engine
runs in a process of its own (:mod:`~fastdeploy.engine.engine_core_proc`), which sends its
:class:`Admission` to the server once it is ready.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastdeploy.core.request import check_prompt, check_sampling
from fastdeploy.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class Admission:
    """What a request is checked against (picklable).

    Attributes:
        max_model_len: tokens one request may reach (prompt + output); a prompt needs room for
            at least one output token.
        vocab_size: token ids must lie in ``[0, vocab_size)``.
        has_tokenizer: stop strings need one.
        max_model_len_note: why ``max_model_len`` is below the configured value (the KV pool),
            named in the error of a prompt too long; None when it is not.
        splitwise_role: ``mixed``, ``prefill`` or ``decode`` (which ``kv_transfer_params`` fit).
        kv_layout: this node's KV layout (what a PD peer's must equal); None outside PD.
        block_size: tokens per KV block.
        tensor_parallel_size: ranks of the model (``prompt_logprobs`` needs 1).
        pd_trust: on a decode node, which prefill nodes a decode leg may name
            (``splitwise.pd_auth.PrefillTrust``); None: loopback ones only.
    """

    max_model_len: int
    vocab_size: int
    has_tokenizer: bool
    max_model_len_note: str | None = None
    splitwise_role: str = "mixed"
    kv_layout: dict | None = None
    block_size: int = 16
    tensor_parallel_size: int = 1
    pd_trust: Any = None

    def check(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        kv_transfer_params: dict | None = None,
    ) -> Any:
        """Check one request. Returns what ``kv_transfer_params`` asks for: None (a plain
        request), True (a prefill leg) or the decode leg's ``RemotePrefill``.

        Raises:
            ValueError: empty prompt, a token id outside the vocabulary, a ``stop_token_ids`` or
                ``logit_bias`` id outside it, stop strings without a tokenizer, or
                ``kv_transfer_params`` this node's role cannot serve (a layout mismatch, a
                prompt length or fingerprint that differs from the prefill node's, a
                prefill node this node does not trust or an unsigned reference:
                ``PrefillTrust.check``), or
                ``prompt_logprobs`` where they cannot be computed (:meth:`_check_prompt_logprobs`).
            PromptTooLongError: a prompt of ``max_model_len`` tokens or more (no room for one
                output token; the message names both lengths, and the KV pool when that is what
                bounds ``max_model_len``).
        """
        check_prompt(prompt_token_ids, self.max_model_len, self.vocab_size, self.max_model_len_note)
        if sampling_params is not None:
            check_sampling(sampling_params, self.vocab_size, self.has_tokenizer)
            if sampling_params.prompt_logprobs is not None:
                self._check_prompt_logprobs(sampling_params.prompt_logprobs, kv_transfer_params)
        if kv_transfer_params is None:
            return None
        from fastdeploy.splitwise.roles import check_decode_leg, check_kv_transfer_params

        leg = check_kv_transfer_params(self.splitwise_role, kv_transfer_params, self.kv_layout)
        if leg not in (None, True):
            from fastdeploy.splitwise.pd_auth import PrefillTrust

            # Before anything connects anywhere: is the prefill node one this node trusts?
            (self.pd_trust or PrefillTrust()).check(kv_transfer_params)
            check_decode_leg(leg, prompt_token_ids, self.vocab_size, self.block_size)
        return leg

    def release_refused_leg(self, params: object) -> bool:
        """A decode leg refused before admission (any 4xx or 503): tell its prefill node to free
        the blocks now, when ``params`` name one this node trusts (:attr:`pd_trust`; see
        :func:`fastdeploy.splitwise.legs.release_refused_leg`). Runs in the server process, as
        :meth:`check` does. Returns whether an ABORT was started."""
        from fastdeploy.splitwise.legs import release_refused_leg

        return release_refused_leg(params, self.pd_trust)

    def _check_prompt_logprobs(self, value: int, kv_transfer_params: dict | None) -> None:
        """Refuse ``prompt_logprobs`` where the prompt's logits are not all computed here:
        a PD role (a decode node pulls the prompt's KV, it computes no prompt logit; a prefill
        leg's outputs travel through the router) and tensor parallelism (the other ranks would
        have to join the LM head's all-gather for those rows).

        Raises:
            ValueError: naming ``prompt_logprobs``, its value and why.
        """
        why = None
        if self.splitwise_role != "mixed" or kv_transfer_params is not None:
            why = (
                f"this server runs splitwise_role={self.splitwise_role!r} (prefill/decode "
                "disaggregation), where the prompt's logits are not computed on one node"
            )
        elif self.tensor_parallel_size > 1:
            why = f"tensor_parallel_size={self.tensor_parallel_size} is not supported yet"
        if why is not None:
            raise ValueError(
                f"prompt_logprobs={value!r} is invalid: {why}; allowed: null (leave it out)"
            )
