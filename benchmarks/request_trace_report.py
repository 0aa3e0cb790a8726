"""Where a served request's time goes: the hops from the client to the engine and back.

Joins a serving benchmark's per-request results (``benchmark_serving.py --json``) with the request
events of a traced server (``benchmarks/step_trace``: ``<prefix>-req.<pid>.jsonl``) by response
id, and prints, in milliseconds (p50, p90 and mean over the requests that have both ends of a
hop):

* the first token's path: client send -> handler -> queued -> engine loop applied it -> end of the
  step that gave its first token -> step message on the server's asyncio thread -> first event
  out -> client read it (the sum is the client's TTFT);
* a slot's idle time between two requests of one closed-loop client (``--concurrency``): end of
  the step that finished a request -> ... -> the client's next request applied by the engine.
  With the overlap schedule the engine learns a token one step after its step, so the slot is
  empty for that long plus this gap.

Every time is ``CLOCK_MONOTONIC`` (the client's ``time.perf_counter`` and the server's
``time.monotonic`` on Linux), so client and server must run on one host::

    STEP_TRACE=/tmp/tr/srv PYTHONPATH=$PWD/benchmarks/step_trace fastdeploy serve ... &
    python benchmarks/benchmark_serving.py --concurrency 64 ... --json /tmp/served.json
    python benchmarks/request_trace_report.py /tmp/served.json /tmp/tr/srv-req.*.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

#: The first token's path: (label, from event, to event).
FIRST_TOKEN_HOPS = [
    ("client send -> handler", "start", "create"),
    ("handler -> queued (admit)", "create", "admit"),
    ("queued -> engine applied", "admit", "add"),
    ("engine applied -> first token's step end", "add", "first_end"),
    ("step end -> message on server loop", "first_end", "first_recv"),
    ("message -> first event out", "first_recv", "sse_first"),
    ("first event out -> client read", "sse_first", "first"),
    ("TTFT (client)", "start", "first"),
]
#: A slot's idle time: (label, event of the finished request, event of the same client's next).
SLOT_GAP_HOPS = [
    ("last step end -> message on server loop", ("fin_end", "fin_recv")),
    ("message -> closing event out", ("fin_recv", "sse_end")),
    ("closing event out -> client read it", ("sse_end", "end")),
    ("client: end -> next send", ("end", "next:start")),
    ("next send -> next applied by engine", ("next:start", "next:add")),
    ("slot gap (last step end -> next applied)", ("fin_end", "next:add")),
]


def load(client_json: str, traces: list[str]) -> list[dict]:
    """One dict of events (seconds) per timed request that the traces know, with the client's
    ``start``, ``first`` (start + TTFT), ``end`` (start + e2e) and ``stream``."""
    events: dict[str, dict] = defaultdict(dict)
    for path in traces:
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                events[rec.pop("rid")].update(rec)
    out = []
    for r in json.load(open(client_json))["results"]:
        rid = r.get("request_id")
        if r.get("error") or rid is None or rid not in events:
            continue
        ev = dict(events[rid])
        ev.update(start=r["start"], first=r["start"] + r["ttft"], end=r["start"] + r["e2e"])
        ev["stream"] = r.get("stream")
        out.append(ev)
    return out


def link_next(requests: list[dict]) -> None:
    """Give each request its closed-loop client's next request's events as ``next:<event>``."""
    by_stream: dict[int, list[dict]] = defaultdict(list)
    for ev in requests:
        if ev.get("stream") is not None:
            by_stream[ev["stream"]].append(ev)
    for evs in by_stream.values():
        evs.sort(key=lambda e: e["start"])
        for a, b in zip(evs, evs[1:]):
            a.update({f"next:{k}": v for k, v in b.items() if isinstance(v, float)})


def stats_ms(values: list[float]) -> tuple[float, float, float, int]:
    """(p50, p90, mean) in ms and the count."""
    if not values:
        return (0.0, 0.0, 0.0, 0)
    s = sorted(values)
    return (
        s[len(s) // 2] * 1e3,
        s[min(len(s) - 1, int(len(s) * 0.9))] * 1e3,
        statistics.fmean(s) * 1e3,
        len(s),
    )


def table(title: str, requests: list[dict], hops: list[tuple[str, str, str]]) -> str:
    lines = [f"\n{title}", f"{'hop':45s} {'p50':>8s} {'p90':>8s} {'mean':>8s} {'n':>6s}"]
    for label, a, b in hops:
        values = [ev[b] - ev[a] for ev in requests if a in ev and b in ev]
        p50, p90, mean, n = stats_ms(values)
        lines.append(f"{label:45s} {p50:8.3f} {p90:8.3f} {mean:8.3f} {n:6d}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("client_json", help="benchmark_serving.py --json output")
    parser.add_argument("traces", nargs="+", help="<prefix>-req.<pid>.jsonl files")
    args = parser.parse_args(argv)
    requests = load(args.client_json, args.traces)
    if not requests:
        raise SystemExit("no request of the client's results is in the traces (ids differ?)")
    link_next(requests)
    text = table(f"first token, {len(requests)} requests (ms)", requests, FIRST_TOKEN_HOPS)
    text += table("slot idle between a client's requests (ms)", requests,
                  [(label, a, b) for label, (a, b) in SLOT_GAP_HOPS])  # fmt: skip
    print(text)
    return text


if __name__ == "__main__":
    main()
