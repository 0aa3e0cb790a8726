"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against Hugging Face transformers.

Both sides dequantise the same GGUF tensors to float32, so the only differences are the order of
floating-point operations (merged q/k/v and gate/up matmuls, paged attention, one query row
against many). Measured on CPU (torch 2.13, transformers 5.24), max abs logit difference, logits
up to ~40 in magnitude: prefill 0.0; decode steps vs a full HF forward 6.0e-5; a mixed step
(chunked prefill + prefill + decode + padding) vs each request alone 3.4e-5.
"""

from __future__ import annotations

import pytest
import torch
from paged_runner import PagedRunner

from fastdeploy.model_executor.model_loader import get_model
from fastdeploy.model_executor.model_loader.source import resolve_model

LOGITS_ATOL = 2e-4  # float32 logits; measured at most 6.0e-5 (see above)
MAX_NEW_TOKENS = 32
PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three fruits that are red.",
]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm():
    """(our model, HF model, tokenizer), loaded once: the HF GGUF load takes ~15 s."""
    from transformers import AutoModelForCausalLM

    try:
        source = resolve_model(None, "auto")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    assert source.load_format == "gguf" and source.gguf_file.endswith(".gguf")
    assert source.tokenizer_kwargs == {"gguf_file": source.gguf_file}
    ours = get_model(source, torch.float32, "cpu", 0)
    hf = AutoModelForCausalLM.from_pretrained(
        source.path, gguf_file=source.gguf_file, dtype=torch.float32
    ).eval()
    return ours, hf, source.load_tokenizer()


def chat_ids(tokenizer, prompt: str) -> list[int]:
    messages = [{"role": "user", "content": prompt}]
    return list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    )


def test_prefill_logits_match_hf(smollm):
    ours, hf, tokenizer = smollm
    ids = chat_ids(tokenizer, PROMPTS[0])
    _, logits = PagedRunner(ours).step([("r", ids)])
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert logits.shape == ref.shape == (len(ids), ours.vocab_size)
    assert (logits - ref).abs().max().item() < LOGITS_ATOL


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_decode_matches_hf_generate(smollm, prompt):
    ours, hf, tokenizer = smollm
    ids = chat_ids(tokenizer, prompt)
    eos = hf.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=MAX_NEW_TOKENS,
            pad_token_id=tokenizer.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
    ref = out.sequences[0, len(ids) :].tolist()
    got, logits = PagedRunner(ours, block_size=16).generate_greedy(
        "r", ids, MAX_NEW_TOKENS, eos_ids
    )
    assert got == ref, (tokenizer.decode(got), tokenizer.decode(ref))
    ref_logits = torch.cat(out.logits).float()
    assert (logits - ref_logits).abs().max().item() < LOGITS_ATOL


def test_mixed_step_with_chunked_prefill_matches_separate_runs(smollm):
    """One step holding a prefill chunk continuing a sequence, a full prefill and a decode token,
    plus padding rows, gives the logits of running each request alone."""
    ours, _, tokenizer = smollm
    a, b = chat_ids(tokenizer, PROMPTS[1]), chat_ids(tokenizer, PROMPTS[2])
    alone = PagedRunner(ours)
    ref_a, _ = alone.step([("a", a)])
    ref_b, _ = alone.step([("b", b + [42])])

    mixed = PagedRunner(ours, block_size=8, block_seed=1)
    mixed.step([("a", a[:-1]), ("b", b[:5])])
    logits, _ = mixed.step([("b", b[5:]), ("a", a[-1:])], pad_to=64)
    assert (logits[1] - ref_a[0]).abs().max().item() < LOGITS_ATOL
    logits, _ = mixed.step([("b", [42])])
    assert (logits[0] - ref_b[0]).abs().max().item() < LOGITS_ATOL


def test_llm_engine_batched_chat_matches_hf_and_answers_paris(smollm):
    """The whole engine (scheduler, paged KV, sampler, detokenizer), all 4 chat prompts in one
    batch, greedy: token for token what HF generates alone for each prompt."""
    from fastdeploy import LLM, SamplingParams

    _, hf, tokenizer = smollm
    llm = LLM(max_num_seqs=8, max_model_len=1024, max_num_batched_tokens=64)
    outs = llm.chat(
        [[{"role": "user", "content": p}] for p in PROMPTS],
        SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS),
        use_tqdm=False,
    )
    for prompt, out in zip(PROMPTS, outs):
        ids = chat_ids(tokenizer, prompt)
        assert out.prompt_token_ids == ids
        with torch.inference_mode():
            ref = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=MAX_NEW_TOKENS,
                pad_token_id=tokenizer.pad_token_id,
            )[0, len(ids) :].tolist()
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].text == tokenizer.decode(ref, skip_special_tokens=True)
    assert "Paris" in outs[0].outputs[0].text
    stats = llm.engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
