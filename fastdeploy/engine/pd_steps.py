"""The engine's prefill/decode bookkeeping, run on the engine thread
(``docs/pd-disaggregation.md``, shared docs): :class:`PDSteps`, owned by
:class:`~fastdeploy.engine.engine.LLMEngine` on a PD node, holds the node's role (a
:class:`~fastdeploy.splitwise.pd_role.PDRole`) and works on the engine's scheduler and KV cache
manager.

* Prefill node: a finished prefill leg's prompt blocks get one more reference and wait in the
  pending-send table (:meth:`PDSteps.hold_for_decode`); what DONE, ABORT or lease expiry
  released is freed at the start of each step.
* Decode node: pulls start once the scheduler gave a decode leg its blocks; a finished pull makes
  the request run from the prefill node's first token (sent out at once), a failed one fails it
  (502) or prefills it here (``recompute``); a request that waited longer than
  ``pd_decode_wait_timeout`` for blocks gets a 503.

Both roles answer every call (a prefill node polls no pulls, a decode node frees no held
blocks), so one step serves both.
"""

from __future__ import annotations

import logging
import os
import time

from fastdeploy.cache_manager.kv_cache_manager import KVCacheManager
from fastdeploy.config import FDConfig
from fastdeploy.core.outputs import EngineOutput
from fastdeploy.core.request import Request, RequestStatus
from fastdeploy.engine.step_pipeline import TokenOutput
from fastdeploy.scheduler.scheduler import Scheduler
from fastdeploy.splitwise.pd_role import PDRole

logger = logging.getLogger("fastdeploy.engine.engine")


def engine_kv_layout(
    config: FDConfig, model_path: str, kv_caches: list, num_kv_heads: int, head_dim: int
) -> dict:
    """An engine's KV layout fingerprint (PD peers must agree on every field).

    Args:
        config: the engine's config (block size, tensor-parallel size).
        model_path: the model's path (its base name is compared).
        kv_caches: the KV tensors, one per layer (their dtype and count are compared).
        num_kv_heads, head_dim: KV heads of this rank and their size.
    """
    from fastdeploy.splitwise.protocol import kv_layout

    return kv_layout(
        model=os.path.basename(str(model_path)),
        dtype=str(kv_caches[0].dtype).removeprefix("torch."),
        num_layers=len(kv_caches),
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=config.cache_config.block_size,
        tp_size=config.parallel_config.tensor_parallel_size,
    )


def error_output(request: Request, error: BaseException) -> EngineOutput:
    """The last output of a request that failed with ``error`` (status ``aborted``)."""
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


class PDSteps:
    """PD bookkeeping of one engine (see the module docstring).

    Args:
        role: this node's role; closed by :meth:`close`.
        scheduler: the engine's scheduler (decode legs wait in it for their KV).
        kv_cache_manager: the engine's (held blocks take and drop references here).
        decode_wait_timeout_s: ``pd_decode_wait_timeout``: seconds a decode leg may wait for
            free blocks before it fails with a 503.
    """

    def __init__(
        self,
        role: PDRole,
        scheduler: Scheduler,
        kv_cache_manager: KVCacheManager,
        decode_wait_timeout_s: float,
    ) -> None:
        self.role = role
        self.scheduler = scheduler
        self.kv_cache_manager = kv_cache_manager
        self.decode_wait_timeout_s = decode_wait_timeout_s
        #: request id -> monotonic deadline of a decode leg still waiting for blocks.
        self.remote_deadlines: dict[str, float] = {}

    def expect_remote_kv(self, request_id: str) -> None:
        """A decode leg was queued: it fails if it waits for blocks past the timeout."""
        self.remote_deadlines[request_id] = time.monotonic() + self.decode_wait_timeout_s

    def abort(self, request_id: str) -> bool:
        """Abort a request (see :meth:`LLMEngine.abort_request`); False if unknown. A pull in
        flight is stopped (its blocks are freed once it ended), a decode leg not yet pulling
        tells its prefill node to free its copy."""
        request = self.scheduler.get_request(request_id)
        if request is None:
            return False
        remote = request.remote_prefill
        pulling = request.status == RequestStatus.WAITING_FOR_REMOTE_KV
        self.scheduler.abort_request(request_id)
        self.remote_deadlines.pop(request_id, None)
        if pulling:
            self.role.cancel(request_id)  # the loader sends ABORT once the pull stopped
        elif remote is not None:
            self.role.abort_remote(remote)
        return True

    def has_background_work(self) -> bool:
        """Blocks held for decode nodes (lease expiry), pulls in flight, or aborted pulls whose
        blocks wait."""
        role = self.role
        return bool(role.has_pending or role.in_flight or self.scheduler.num_cancelled_loads)

    def held_block_tables(self) -> list[list[int]]:
        """The block lists held for decode nodes (for the integrity check)."""
        return list(self.role.held_block_tables())

    def step(self, now: float, token_output: TokenOutput) -> list[EngineOutput]:
        """Free what decode nodes released; finish or fail pulls; time out waits. Returns the
        outputs that go out before this step's forward: errors, and the first tokens whose KV
        landed, built by ``token_output`` (the engine's; given per call, so this object holds
        no reference to the engine)."""
        for _rid, blocks, _reason in self.role.take_freed():
            self.kv_cache_manager.release_blocks(blocks)
        outputs: list[EngineOutput] = []
        for result in self.role.poll():
            output = self._pull_ended(result.request_id, result.error, now, token_output)
            if output is not None:
                outputs.append(output)
        outputs += self._time_out_waits(now)
        self.role.set_waiting(
            [r.remote_prefill for r in self.scheduler.waiting if r.remote_prefill is not None]
        )
        return outputs

    def _pull_ended(
        self, rid: str, error: str | None, now: float, token_output: TokenOutput
    ) -> EngineOutput | None:
        """A pull ended: the request runs (its first token's output), recomputes, or fails."""
        scheduler = self.scheduler
        if scheduler.release_cancelled(rid):
            return None
        request = scheduler.get_request(rid)
        if request is None or request.remote_prefill is None:
            return None
        remote = request.remote_prefill
        if error is None:
            if remote.first_token_id in request.min_tokens_stop_ids:
                # The client's min_tokens masks the prefill node's token (eos or a stop
                # id): recompute the last prompt token here and sample under the mask.
                scheduler.remote_kv_loaded(rid, None)
                return None
            scheduler.remote_kv_loaded(rid, remote.first_token_id)
            logprobs = remote.first_token_logprobs
            if logprobs is not None and request.sampling_params.logprobs is not None:
                request.output_logprobs.extend(logprobs)
            else:
                logprobs = None
            return token_output(request, remote.first_token_id, logprobs, now)
        logger.warning("request %s: KV transfer failed: %s", rid, error)
        if self.role.failure_policy == "recompute":
            scheduler.remote_kv_failed(rid, recompute=True)
            return None
        from fastdeploy.core.errors import KVTransferError

        scheduler.remote_kv_failed(rid, recompute=False)
        scheduler.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return error_output(
            request, KVTransferError(f"PD transfer failed for request {rid}: {error}")
        )

    def _time_out_waits(self, now: float) -> list[EngineOutput]:
        """Fail the decode legs that waited for blocks past ``pd_decode_wait_timeout``."""
        outputs = []
        for rid, deadline in list(self.remote_deadlines.items()):
            request = self.scheduler.get_request(rid)
            if request is None or request.status != RequestStatus.WAITING:
                del self.remote_deadlines[rid]
            elif now > deadline:
                from fastdeploy.core.errors import KVWaitTimeoutError

                del self.remote_deadlines[rid]
                self.abort(rid)
                wait_s = self.decode_wait_timeout_s
                error = KVWaitTimeoutError(
                    f"request {rid} waited {wait_s:g} s (pd_decode_wait_timeout) for free KV "
                    "blocks on this decode node; retry later or add decode capacity"
                )
                outputs.append(error_output(request, error))
        return outputs

    def start_pulls(self) -> None:
        """Start the pulls of the decode-leg requests the scheduler just gave blocks."""
        for request in self.scheduler.take_new_remote_loads():
            self.role.start(
                request.request_id,
                request.remote_prefill,
                request.block_ids,
                request.num_cached_tokens,
            )

    def hold_for_decode(self, request: Request, token_id: int, logprobs: list[dict] | None) -> dict:
        """Keep a finished prefill leg's prompt blocks for the decode node (one more reference
        each, dropped on DONE, ABORT or lease expiry); returns its ``kv_transfer_params``."""
        from fastdeploy.splitwise.protocol import prompt_fingerprint

        n = self.kv_cache_manager.num_blocks_for(request.num_prompt_tokens)
        blocks = list(request.block_ids[:n])
        self.kv_cache_manager.hold_blocks(blocks)
        return self.role.hold(
            request.request_id,
            blocks,
            request.num_prompt_tokens,
            token_id,
            logprobs,
            prompt_fingerprint(request.prompt_token_ids),
        )

    def close(self) -> None:
        """Close the role (its side channel, transport and threads)."""
        self.role.close()
