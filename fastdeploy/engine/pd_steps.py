"""The engine's prefill/decode bookkeeping, run on the engine thread
(``docs/pd-disaggregation.md``, shared docs): a mixin of :class:`~fastdeploy.engine.engine.
LLMEngine`, which owns ``self.pd`` (the role object of :mod:`fastdeploy.splitwise.roles`), the
scheduler and the KV cache manager.

* Prefill node: a finished prefill leg's prompt blocks get one more reference and wait in the
  pending-send table (:meth:`PDStepMixin._hold_for_decode`); what DONE, ABORT or lease expiry
  released is freed at the start of each step.
* Decode node: pulls start once the scheduler gave a decode leg its blocks; a finished pull makes
  the request run from the prefill node's first token (sent out at once), a failed one fails it
  (502) or prefills it here (``recompute``); a request that waited longer than
  ``pd_decode_wait_timeout`` for blocks gets a 503.
"""

from __future__ import annotations

import logging

from fastdeploy.core.outputs import EngineOutput
from fastdeploy.core.request import Request, RequestStatus

logger = logging.getLogger("fastdeploy.engine.engine")


class PDStepMixin:
    """PD bookkeeping of :class:`~fastdeploy.engine.engine.LLMEngine`."""

    def _kv_layout(self) -> dict:
        """This engine's KV layout fingerprint (PD peers must agree on every field)."""
        import os

        from fastdeploy.splitwise.protocol import kv_layout

        kv = self.worker.kv_caches
        return kv_layout(
            model=os.path.basename(str(self.source.path)),
            dtype=str(kv[0].dtype).removeprefix("torch."),
            num_layers=len(kv),
            num_kv_heads=self.worker.num_kv_heads,
            head_dim=self.worker.head_dim,
            block_size=self.config.cache_config.block_size,
            tp_size=self.config.parallel_config.tensor_parallel_size,
        )

    def _pd_step(self, now: float) -> list[EngineOutput]:
        """Free what decode nodes released; start, finish or fail pulls; time out waits."""
        from fastdeploy.splitwise.roles import PrefillRole

        pd = self.pd
        if isinstance(pd, PrefillRole):
            for _rid, blocks, _reason in pd.take_freed():
                self.kv_cache_manager.release_blocks(blocks)
            return []
        outputs: list[EngineOutput] = []
        for result in pd.poll():
            rid = result.request_id
            if self.scheduler.release_cancelled(rid):
                continue
            request = self.scheduler.get_request(rid)
            if request is None or request.remote_prefill is None:
                continue
            remote = request.remote_prefill
            if result.error is None:
                if remote.first_token_id in request.min_tokens_stop_ids:
                    # The client's min_tokens masks the prefill node's token (eos or a stop
                    # id): recompute the last prompt token here and sample under the mask.
                    self.scheduler.remote_kv_loaded(rid, None)
                    continue
                self.scheduler.remote_kv_loaded(rid, remote.first_token_id)
                logprobs = remote.first_token_logprobs
                if logprobs is not None and request.sampling_params.logprobs is not None:
                    request.output_logprobs.extend(logprobs)
                else:
                    logprobs = None
                outputs.append(self._token_output(request, remote.first_token_id, logprobs, now))
                continue
            logger.warning("request %s: KV transfer failed: %s", rid, result.error)
            if pd.failure_policy == "recompute":
                self.scheduler.remote_kv_failed(rid, recompute=True)
                continue
            from fastdeploy.core.errors import KVTransferError

            self.scheduler.remote_kv_failed(rid, recompute=False)
            self.scheduler.finish_request(request, RequestStatus.FINISHED_ABORTED)
            error = KVTransferError(f"PD transfer failed for request {rid}: {result.error}")
            outputs.append(self._error_output(request, error))
        for rid, deadline in list(self._remote_deadlines.items()):
            request = self.scheduler.get_request(rid)
            if request is None or request.status != RequestStatus.WAITING:
                del self._remote_deadlines[rid]
            elif now > deadline:
                from fastdeploy.core.errors import KVWaitTimeoutError

                del self._remote_deadlines[rid]
                self.abort_request(rid)
                wait_s = self.config.splitwise_config.pd_decode_wait_timeout
                error = KVWaitTimeoutError(
                    f"request {rid} waited {wait_s:g} s (pd_decode_wait_timeout) for free KV "
                    "blocks on this decode node; retry later or add decode capacity"
                )
                outputs.append(self._error_output(request, error))
        pd.set_waiting(
            [r.remote_prefill for r in self.scheduler.waiting if r.remote_prefill is not None]
        )
        return outputs

    def _start_pulls(self) -> None:
        """Start the pulls of the decode-leg requests the scheduler just gave blocks."""
        for request in self.scheduler.take_new_remote_loads():
            self.pd.start(
                request.request_id,
                request.remote_prefill,
                request.block_ids,
                request.num_cached_tokens,
            )

    @staticmethod
    def _error_output(request: Request, error: BaseException) -> EngineOutput:
        return EngineOutput(
            request.request_id,
            [],
            None,
            True,
            RequestStatus.FINISHED_ABORTED.value,
            request.num_prompt_tokens,
            request.reported_cached_tokens,
            error=error,
        )

    def _hold_for_decode(self, request: Request, token_id: int, logprobs) -> dict:
        """Keep a finished prefill leg's prompt blocks for the decode node (one more reference
        each, dropped on DONE, ABORT or lease expiry); returns its ``kv_transfer_params``."""
        n = self.kv_cache_manager.num_blocks_for(request.num_prompt_tokens)
        blocks = list(request.block_ids[:n])
        self.kv_cache_manager.hold_blocks(blocks)
        from fastdeploy.splitwise.protocol import prompt_fingerprint

        return self.pd.hold(
            request.request_id,
            blocks,
            request.num_prompt_tokens,
            token_id,
            logprobs,
            prompt_fingerprint(request.prompt_token_ids),
        )
