"""Offline: decode time per step with and without a JSON schema, at 1 and N streams, and the
steps by graph mode (docs/structured-output.md).

    python3 benchmarks/bench_structured_output.py [--model PATH.gguf] [--streams 1 64]

Greedy, ``ignore_eos`` off, ``max_tokens`` 160; every schema output is checked with ``json.loads``
and the schema's required keys. Prints one row per (streams, schema): wall time, decode steps,
ms per step, output tokens per second, the steps by mode, and how many outputs were valid.
"""

from __future__ import annotations

import argparse
import json
import time

from accuracy.grammar import BUILTIN_SCHEMA as SCHEMA  # benchmarks/ is on sys.path


def main() -> None:
    import torch

    from fastdeploy import LLM, SamplingParams
    from fastdeploy.core.structured_output import StructuredOutputsParams

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--max-tokens", type=int, default=160)
    a = ap.parse_args()
    llm = LLM(a.model, max_model_len=1024, max_num_seqs=max(a.streams), block_size=16)
    ask = [{"role": "user", "content": "Describe a user of a website as JSON."}]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"device {device}; model {a.model or 'default SmolLM2-135M GGUF'}; greedy")
    print("streams schema  wall_s  steps  ms/step  tok/s   valid  steps_by_mode")
    for n in a.streams:
        for schema in (False, True):
            so = StructuredOutputsParams(json=SCHEMA) if schema else None
            params = SamplingParams(temperature=0, max_tokens=a.max_tokens, structured_outputs=so)
            llm.chat([ask] * n, params, use_tqdm=False)  # warm: compile, caches
            before = dict(llm.engine.get_stats()["steps_by_mode"])
            t = time.perf_counter()
            outs = [o.outputs[0] for o in llm.chat([ask] * n, params, use_tqdm=False)]
            wall = time.perf_counter() - t
            after = llm.engine.get_stats()["steps_by_mode"]
            modes = {k: after[k] - before.get(k, 0) for k in after}
            steps = sum(modes.values())
            tokens = sum(len(o.token_ids) for o in outs)
            valid = "-"
            if schema:
                ok = 0
                for o in outs:
                    try:
                        ok += set(SCHEMA["required"]) <= set(json.loads(o.text))
                    except ValueError:
                        pass
                valid = f"{ok}/{n}"
            print(
                f"{n:7d} {str(schema):6s} {wall:7.2f} {steps:6d} {wall / steps * 1e3:8.2f} "
                f"{tokens / wall:7.0f} {valid:>6s}  {modes}"
            )


if __name__ == "__main__":
    main()
