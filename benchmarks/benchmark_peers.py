"""Our engine against Hugging Face ``transformers`` on one decode workload, in one run.

One command (CUDA host)::

    python benchmarks/benchmark_peers.py        # SmolLM2-135M and Llama-3-8B shapes, batch 1/16/64
    python benchmarks/benchmark_peers.py --models smollm2-135m --systems fastdeploy-graph hf-compile

Systems, each on the same model shape with random weights (``load_format=dummy`` for ours, the
``transformers`` initialisation for theirs), in ``--dtype``:

* ``fastdeploy-graph``: our offline ``LLM``, CUDA graphs on (the default capture ladders);
* ``fastdeploy-eager``: the same with ``use_cudagraph=false``;
* ``hf-eager``: ``model.generate`` with the default dynamic cache, PyTorch eager;
* ``hf-compile``: ``model.generate`` with ``cache_implementation="static"`` and a
  ``CompileConfig(fullgraph=True, mode="reduce-overhead")``: the ``transformers`` guide "Optimizing
  inference" (static kv-cache and torch.compile). Recent ``transformers`` compile the decode
  forward themselves when the cache is static, with this config; the guide's extra
  ``model.forward = torch.compile(...)`` would also compile the 32-token prefill shape (one step
  of 129) and double the compile time, so it is not applied. The first ``generate`` of each batch
  size compiles (warm-up s).

Workload: per batch size ``B``, ``B`` random prompts of ``--input-len`` token ids (seeded), greedy,
exactly ``--output-len`` new tokens each (``ignore_eos`` for ours, ``min_new_tokens`` for theirs).
Each system starts once per model (start-up s: our engine's construction with memory profiling and
graph capture, or building the ``transformers`` model); then per batch size one warm-up
``generate`` on other prompts of the same shape (warm-up s; the full output length for
``hf-compile``, whose static cache and graphs depend on it, 8 tokens otherwise) and one timed
``generate``. tok/s = ``B * output_len / wall``; ms/step = ``wall / output_len`` (one step makes
one token per request; the prefill step is amortised into it). A system that fails prints its
error in the table and the run goes on.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from benchmark_throughput import device_name

from fastdeploy.model_executor.model_loader.presets import PRESETS, write_preset

SYSTEMS = ("fastdeploy-graph", "fastdeploy-eager", "hf-eager", "hf-compile")
# Warm-up length of the systems whose shapes do not depend on the output length.
SHORT_WARMUP_TOKENS = 8


@dataclass
class Workload:
    """Prompt and output lengths (tokens) and the seed of the prompts."""

    input_len: int
    output_len: int
    seed: int = 0

    def prompts(self, vocab_size: int, batch: int, warmup: bool) -> list[list[int]]:
        """``batch`` prompts of ``input_len`` random ids; the warm-up set differs from the timed
        one, so no prefix of the timed prompts is cached by the warm-up."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + 2 * batch + int(warmup))
        return torch.randint(0, vocab_size, (batch, self.input_len), generator=g).tolist()


@dataclass
class Row:
    system: str
    model: str
    batch: int
    tok_s: float | None = None
    ms_step: float | None = None
    startup_s: float | None = None
    warmup_s: float | None = None
    error: str | None = None


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class FastDeployPeer:
    """Our offline ``LLM`` with CUDA graphs on or off."""

    full_warmup = False

    def __init__(self, model_dir: str, device: str, dtype: str, max_batch: int, w: Workload,
                 graphs: bool) -> None:  # fmt: skip
        self.engine_args = dict(
            load_format="dummy",
            dtype=dtype,
            device=device,
            seed=0,
            skip_tokenizer_init=True,
            max_num_seqs=max_batch,
            max_model_len=w.input_len + w.output_len,
            graph_optimization_config={"use_cudagraph": graphs},
        )
        self.model_dir = model_dir
        self.llm = None
        from fastdeploy import LLM  # imported here, so start-up does not count Python imports

        self.llm_class = LLM

    def start(self) -> None:
        self.llm = self.llm_class(self.model_dir, **self.engine_args)

    def generate(self, prompts: list[list[int]], new_tokens: int) -> int:
        """Greedy ``new_tokens`` for every prompt; returns the output tokens made."""
        from fastdeploy import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    def close(self) -> None:
        if self.llm is not None:
            self.llm.engine.shutdown()
        self.llm = None


class HFPeer:
    """A ``transformers`` causal LM built from the same config, eager or static cache + compile."""

    def __init__(self, model_dir: str, device: str, dtype: str, compiled: bool) -> None:
        self.model_dir, self.device, self.dtype = model_dir, device, getattr(torch, dtype)
        self.compiled = compiled
        self.full_warmup = compiled
        self.model = None
        import transformers  # noqa: F401  imported here, so start-up does not count it

    def start(self) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, CompileConfig

        config = AutoConfig.from_pretrained(self.model_dir)
        with torch.device(self.device):  # random init on the device: seconds, not minutes
            model = AutoModelForCausalLM.from_config(config, dtype=self.dtype)
        model = model.to(self.dtype).eval()  # transformers < 4.56 call it torch_dtype
        gen = model.generation_config
        eos = config.eos_token_id
        gen.pad_token_id = eos[0] if isinstance(eos, list) else eos
        if self.compiled:
            gen.cache_implementation = "static"
            gen.compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead")
            if self.device == "cpu":  # transformers compiles on CUDA only unless told
                gen.compile_config._compile_all_devices = True
        self.model = model

    def generate(self, prompts: list[list[int]], new_tokens: int) -> int:
        ids = torch.tensor(prompts, device=self.device)
        out = self.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
        )
        return (out.shape[1] - ids.shape[1]) * out.shape[0]

    def close(self) -> None:
        self.model = None
        torch._dynamo.reset()  # compiled code and the cudagraph trees' memory pool


def make_peer(name: str, model_dir: str, args, w: Workload):
    """The system ``name`` (one of :data:`SYSTEMS`), not started yet."""
    max_batch = max(args.batch_sizes)
    factories = {
        "fastdeploy-graph": lambda: FastDeployPeer(model_dir, args.device, args.dtype, max_batch,
                                                   w, graphs=True),
        "fastdeploy-eager": lambda: FastDeployPeer(model_dir, args.device, args.dtype, max_batch,
                                                   w, graphs=False),
        "hf-eager": lambda: HFPeer(model_dir, args.device, args.dtype, compiled=False),
        "hf-compile": lambda: HFPeer(model_dir, args.device, args.dtype, compiled=True),
    }  # fmt: skip
    if name not in factories:
        raise ValueError(f"unknown system {name!r}; valid: {', '.join(SYSTEMS)}")
    return factories[name]()


def error_text(e: BaseException) -> str:
    traceback.print_exc()
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_system(name: str, model: str, model_dir: str, args, w: Workload, vocab: int) -> list[Row]:
    """Start system ``name`` on ``model`` and time every batch size; failures become rows."""
    rows: list[Row] = []
    peer = None
    try:
        peer = make_peer(name, model_dir, args, w)
        t0 = time.perf_counter()
        peer.start()
        synchronize(args.device)
        startup = time.perf_counter() - t0
    except Exception as e:  # a system that cannot start fails its rows, not the run
        msg = error_text(e)
        if peer is not None:
            peer.close()
        free_memory()
        return [Row(name, model, b, error=msg) for b in args.batch_sizes]
    try:
        for b in args.batch_sizes:
            row = Row(name, model, b, startup_s=startup)
            try:
                warm = w.output_len if peer.full_warmup else min(SHORT_WARMUP_TOKENS, w.output_len)
                t0 = time.perf_counter()
                peer.generate(w.prompts(vocab, b, warmup=True), warm)
                synchronize(args.device)
                row.warmup_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                made = peer.generate(w.prompts(vocab, b, warmup=False), w.output_len)
                synchronize(args.device)
                wall = time.perf_counter() - t0
                if made != b * w.output_len:
                    raise RuntimeError(f"made {made} tokens, expected {b * w.output_len}")
                row.tok_s, row.ms_step = made / wall, wall / w.output_len * 1000
            except Exception as e:
                row.error = error_text(e)
            rows.append(row)
            print(f"done: {row}", file=sys.stderr, flush=True)  # progress of a long run
    finally:
        peer.close()
        free_memory()
    return rows


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[Row], args) -> None:
    import transformers

    print(
        f"\nPeers | {device_name()} | torch {torch.__version__}, transformers "
        f"{transformers.__version__} | dtype {args.dtype}, random weights | {args.input_len}-token "
        f"random prompts, {args.output_len} new tokens each, greedy, seed {args.seed}"
    )
    head = (f"{'system':<17} {'model':<14} {'batch':>5} {'tok/s':>9} {'ms/step':>8} "
            f"{'start-up s':>10} {'warm-up s':>9}")  # fmt: skip
    print(head)
    print("-" * len(head))
    for r in rows:
        line = (f"{r.system:<17} {r.model:<14} {r.batch:>5} {fmt(r.tok_s, '9.0f'):>9} "
                f"{fmt(r.ms_step, '8.2f'):>8} {fmt(r.startup_s, '10.1f'):>10} "
                f"{fmt(r.warmup_s, '9.1f'):>9}")  # fmt: skip
        print(line + (f"  ERROR {r.error[:100]}" if r.error else ""))
    if args.device == "cuda":
        print(
            "start-up of our first engine of a shape may include flashinfer's one-time JIT build "
            "(cached on disk for later engines); hf-compile's warm-up is its torch.compile"
        )
    else:
        print("CPU: no CUDA graphs, so fastdeploy-graph runs eagerly; hf-compile compiles only")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models",
        nargs="+",
        default=["smollm2-135m", "llama3-8b"],
        help=f"presets ({', '.join(PRESETS)}) or directories with a config.json",
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        choices=["cuda", "cpu"])  # fmt: skip
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args(argv)
    for name in ("input_len", "output_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.batch_sizes) < 1:
        parser.error("--batch-sizes must be >= 1")
    return args


def main(argv: list[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(args.seed)
    w = Workload(args.input_len, args.output_len, args.seed)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, model in enumerate(args.models):
            model_dir = model if Path(model).is_dir() else write_preset(model, Path(tmp) / str(i))
            vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
            name = Path(model).name if Path(model).is_dir() else model
            for system in args.systems:
                rows += run_system(system, name, model_dir, args, w, vocab)
                if args.json:  # after each system: a run cut short keeps what it measured
                    write_json(args.json, rows, args)
    print_table(rows, args)
    return rows


def write_json(path: str, rows: list[Row], args) -> None:
    """The rows so far and the run's settings, as ``--json`` documents them."""
    payload = {
        "device": device_name(),
        "dtype": args.dtype,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "seed": args.seed,
        "rows": [asdict(r) for r in rows],
    }
    Path(path).write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
