"""Tables of a step trace (``benchmarks/step_trace/sitecustomize.py``): per traced process, the
steps by graph mode with the mean milliseconds of each part, and how much the decode steps that
re-planned their graph's attention cost over those that kept their plan::

    python benchmarks/step_trace_report.py /tmp/tr.*.jsonl [--skip-s 0]

``--skip-s`` drops the steps of the first seconds of each trace (a server's warm-up requests and
the clients' start); a trace holds every step of its process, warm-up included. Times are host
time: a part that waits for the device (``result``, ``finish``) includes the wait (``wait``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

#: Parts in the order printed (those absent from a trace are left out).
PARTS = (
    "schedule", "launch", "prepare", "replay_full", "replay_pw", "plan_gd", "plan",
    "plan_dec_direct", "build_md", "samp_prep", "logits", "logits_pw", "sampler", "out_stage",
    "result", "wait", "finish", "drain", "stats", "emit",
)  # fmt: skip


def load(path: Path, skip_s: float = 0.0) -> list[dict]:
    """The step records of one trace file, in time order, without those of the first
    ``skip_s`` seconds and without steps that ran no forward (no ``mode``). A line that is not
    a record (the last one of a trace whose process was killed mid-write) is skipped with a
    line on stderr naming it.

    Raises:
        OSError: the file cannot be read.
    """
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            print(f"{path}:{number}: skipped, not a step record ({e})", file=sys.stderr)
    records.sort(key=lambda r: r["t0"])
    if records:
        start = records[0]["t0"] + skip_s
        records = [r for r in records if r["t0"] >= start]
    return [r for r in records if "mode" in r]


def mean_ms(records: list[dict], key: str) -> float:
    return 1e3 * statistics.fmean(r.get(key, 0.0) for r in records) if records else 0.0


def replanned(record: dict) -> bool:
    """Whether a decode step re-planned its graph (through flashinfer's plan() or directly)."""
    return bool(record.get("n_plan") or record.get("n_plan_dec_direct"))


def report(path: Path, skip_s: float = 0.0) -> str:
    """The tables of one trace file, as text (one line when it cannot be read)."""
    try:
        records = load(path, skip_s)
    except OSError as e:
        return f"{path}: cannot read ({e.strerror or e})"
    if not records:
        return f"{path}: no steps"
    end = records[-1]["t0"] + records[-1]["dt"]
    gaps = [b["t0"] - (a["t0"] + a["dt"]) for a, b in zip(records, records[1:])]
    parts = [p for p in PARTS if any(p in r for r in records)]
    lines = [
        f"{path}: {len(records)} steps over {end - records[0]['t0']:.2f} s, "
        f"{sum(r['dt'] for r in records):.2f} s in steps; gap between steps p50 "
        f"{1e3 * statistics.median(gaps) if gaps else 0.0:.3f} ms",
        "| steps | n | requests | tokens | total s | step ms | " + " | ".join(parts) + " |",
        "|---" * (6 + len(parts)) + "|",
    ]

    def row(label: str, rs: list[dict]) -> str:
        cells = [
            label, str(len(rs)), f"{statistics.fmean(r['nreq'] for r in rs):.1f}",
            f"{statistics.fmean(r['ntok'] for r in rs):.1f}", f"{sum(r['dt'] for r in rs):.2f}",
            f"{mean_ms(rs, 'dt'):.3f}", *(f"{mean_ms(rs, p):.3f}" for p in parts),
        ]  # fmt: skip
        return "| " + " | ".join(cells) + " |"

    for mode in ("full", "piecewise", "eager"):
        rs = [r for r in records if r["mode"] == mode]
        if rs:
            lines.append(row(mode, rs))
        if mode == "full" and rs:
            again = [r for r in rs if replanned(r)]
            kept = [r for r in rs if not replanned(r)]
            for label, group in (("full, re-planned", again), ("full, plan kept", kept)):
                if group:
                    lines.append(row(label, group))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", type=Path, help="<prefix>.<pid>.jsonl files")
    parser.add_argument("--skip-s", type=float, default=0.0, help="drop the first seconds")
    args = parser.parse_args(argv)
    if args.skip_s < 0:
        parser.error(f"--skip-s must be >= 0, got {args.skip_s}")
    print("\n\n".join(report(p, args.skip_s) for p in args.traces))


if __name__ == "__main__":
    main()
