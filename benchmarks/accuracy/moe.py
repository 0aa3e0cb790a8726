"""The ``moe`` path's own workload: the ``tiny-qwen3-moe`` preset with random weights, saved as a
Hugging Face checkpoint so that HF float32 and our engine load the same numbers.

Weights are drawn wider than the usual 0.02 init (norms away from 1, routers spread out) so that
routing is decided by the weights and the logits are not flat (as in
``tests/model_executor/test_moe_models.py``; random weights otherwise make every position a
near-tie, see ``docs/accuracy.md``). Prompts are random token ids: the preset has a 256-token
vocabulary and no tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

PRESET = "tiny-qwen3-moe"
#: Prompt lengths (tokens) of the MoE workload; the harness takes the first ``num_prompts``.
PROMPT_LENGTHS = [7, 23, 41, 64, 100, 150, 17, 33, 88, 120, 5, 57, 75, 131, 12, 200]
TEXT_TOKENS = 256
EOS_IDS = (2,)


@dataclass(frozen=True)
class MoeWorkload:
    """A saved checkpoint directory, its HF model (float32, eval), prompts and a text."""

    directory: str
    hf: torch.nn.Module
    prompts: list[list[int]]
    text_ids: list[int]


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Draw every parameter wide: norms ``1 + 0.2 N(0,1)``, vectors ``0.1 N``, matrices
    ``0.15 N`` (the recipe of ``tests/model_executor/test_moe_models.py``)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1 + 0.2 * noise)
            else:
                p.copy_(noise * (0.1 if p.ndim == 1 else 0.15))


def build_moe_workload(directory: Path, num_prompts: int, device: str) -> MoeWorkload:
    """Write the preset, draw the weights (seeded), save them to ``directory``, make prompts.

    Raises:
        ValueError: ``num_prompts`` above ``len(PROMPT_LENGTHS)``.
    """
    import transformers

    from fastdeploy.model_executor.model_loader.presets import write_preset

    if num_prompts > len(PROMPT_LENGTHS):
        raise ValueError(f"num_prompts={num_prompts}; the MoE workload has {len(PROMPT_LENGTHS)}")
    write_preset(PRESET, directory)
    cfg = transformers.AutoConfig.from_pretrained(directory)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    randomize(hf, seed=1)
    hf.save_pretrained(directory)
    g = torch.Generator().manual_seed(2)
    low = max(EOS_IDS) + 1
    prompts = [
        torch.randint(low, cfg.vocab_size, (n,), generator=g).tolist()
        for n in PROMPT_LENGTHS[:num_prompts]
    ]
    text = torch.randint(low, cfg.vocab_size, (TEXT_TOKENS,), generator=g).tolist()
    return MoeWorkload(str(directory), hf.to(device), prompts, text)
