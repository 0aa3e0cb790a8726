"""Serving benchmark: drive a running OpenAI-compatible server and report throughput and latency.

One command (any server with ``/v1/completions``: ours, vLLM, SGLang, a router)::

    python benchmarks/benchmark_serving.py --base-url http://127.0.0.1:8000 --concurrency 16 \\
        --num-prompts 256 --input-len 256 --output-len 128
    python benchmarks/benchmark_serving.py --request-rate 8 --num-prompts 200 --json out.json

Prompts are random token ids (a fixed ``--seed``) sent as token-id prompts, so no tokenizer is
needed and every server sees the same input lengths; ``--range-ratio r`` draws each length
uniformly from ``[len * (1 - r), len * (1 + r)]``. Every request streams with ``ignore_eos`` and
``max_tokens`` set, so the output length is what was asked (but see ``--json-schema`` below).
Either ``--concurrency N`` clients run back to back, or requests arrive as a Poisson process of
``--request-rate`` per second.

Metrics follow the field's definitions (as vLLM's and SGLang's serving benchmarks report them):

* TTFT: request sent -> first streamed token;
* TPOT: ``(e2e - TTFT) / (output tokens - 1)`` per request;
* ITL: the gaps between consecutive streamed chunks, over all requests;
* throughput: requests, output tokens and total tokens per second of the whole run.

Where the server exposes this project's Prometheus counters at ``/metrics``
(``fastdeploy:steps`` by graph mode, ``fastdeploy:generation_tokens``), the table also gives the
engine's steps during the run by mode, output tokens per step and run seconds per step: a served
run that takes more steps than an offline one for the same tokens shows it there. Servers
without them (vLLM, SGLang, a router) leave the line out.

Structured output. ``--json-schema PATH_OR_JSON`` (vLLM's structured-output benchmark calls it
``--json-schema-path``, also accepted; ``default`` is ``benchmarks/bench_schema.json``) puts
OpenAI's ``response_format`` ``json_schema`` (strict) on every request, warm-up included, and
checks each output against the schema (``jsonschema`` where installed, else ``json.loads`` only:
the table says which): the table prints ``schema-valid: k/N`` and the ``--json`` summary has
``schema_valid`` and ``schema_checked``. A grammar that ends stops the request (``stop``) before
``max_tokens``, so under a schema the output tokens are what was generated, not
``--output-len``; the table gives both and the finish reasons.

Percentiles are p50, p95 and p99. Output tokens come from the final usage chunk
(``stream_options.include_usage``) where the server sends it, else from the chunks' token counts.

Prefix cache. The same ``--seed`` and lengths give the same prompts (with another
``--input-len``, the first prompt of the shorter run begins the first of the longer one), so a
second run against the same server finds its prompts in the server's prefix cache and its TTFT
measures cache hits, not prefills. Where the usage chunk
carries OpenAI's ``prompt_tokens_details.cached_tokens`` (this server, vLLM), the table says how
many prompt tokens the cache served and, when any did, warns; use another ``--seed`` (or a server
without prefix caching) for prefill TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from schema_check import DEFAULT_SCHEMA, SchemaChecker, load_json_schema, request_fields


@dataclass
class RequestResult:
    """One request: lengths in tokens, times in seconds; ``error`` when it failed."""

    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str | None = None
    #: prompt tokens the server's prefix cache served (``usage.prompt_tokens_details``); 0 when
    #: the server does not report them (``cached_tokens_reported`` False)
    cached_tokens: int = 0
    cached_tokens_reported: bool = False
    #: when it was sent (``time.perf_counter`` seconds: ``CLOCK_MONOTONIC`` on Linux, the clock a
    #: server on the same host stamps with ``time.monotonic``), the response's ``id``, and which
    #: closed-loop client sent it (``--concurrency``; None with ``--request-rate``): for joining
    #: a run with a server-side trace (``benchmarks/request_trace_report.py``)
    start: float = 0.0
    request_id: str | None = None
    stream: int | None = None
    #: the choice's ``finish_reason`` (``length`` at ``max_tokens``; ``stop`` at EOS or, under
    #: ``--json-schema``, where the grammar ends, often before ``--output-len``)
    finish_reason: str | None = None
    #: the output text, kept only with ``--json-schema``; ``schema_valid`` is then whether it is
    #: JSON the schema accepts (None without a schema)
    text: str | None = None
    schema_valid: bool | None = None


def make_prompts(
    n: int, input_len: int, output_len: int, range_ratio: float, vocab: int, seed: int
) -> list[tuple[list[int], int]]:
    """``n`` (token ids, max tokens) pairs, random with ``seed``; ids in ``[10, vocab)``."""
    rng = random.Random(seed)

    def length(base: int) -> int:
        lo, hi = int(base * (1 - range_ratio)), int(base * (1 + range_ratio))
        return max(1, rng.randint(lo, hi))

    return [
        ([rng.randrange(10, vocab) for _ in range(length(input_len))], length(output_len))
        for _ in range(n)
    ]


async def run_one(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompt: list[int],
    max_tokens: int,
    fields: dict | None = None,
) -> RequestResult:
    """Stream one completion and time it; the usage chunk gives the output length and, where
    the server reports them, the prompt tokens served from its prefix cache. ``fields`` are
    added to the body (``--json-schema``'s ``response_format``); with them the output text is
    kept (``RequestResult.text``) for checking."""
    result = RequestResult(len(prompt))
    texts: list[str] | None = [] if fields else None
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(fields or {}),
    }
    start = last = result.start = time.perf_counter()
    counted = 0
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if result.request_id is None:
                    result.request_id = chunk.get("id")
                usage = chunk.get("usage")
                if usage:
                    result.output_len = usage["completion_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        result.cached_tokens = details["cached_tokens"]
                        result.cached_tokens_reported = True
                choices = chunk.get("choices") or []
                if not choices:
                    continue
                if choices[0].get("finish_reason"):
                    result.finish_reason = choices[0]["finish_reason"]
                if texts is not None:
                    texts.append(choices[0].get("text") or "")
                now = time.perf_counter()
                if counted == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                counted += max(1, len(choices[0].get("token_ids") or []))
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e = time.perf_counter() - start
    result.output_len = result.output_len or counted
    if texts is not None:
        result.text = "".join(texts)
    return result


async def drive(
    args: argparse.Namespace,
    model: str,
    items: list[tuple[int, list[int], int]],
    concurrency: int,
    request_rate: float | None,
    seed: int,
    start_at: float | None = None,
    stream_base: int = 0,
) -> tuple[dict[int, RequestResult], float, float]:
    """Send ``items`` (index, prompt, max tokens): ``concurrency`` clients back to back, or
    Poisson arrivals at ``request_rate``. Starts at ``time.time() == start_at`` when given; the
    clients are numbered from ``stream_base`` (``RequestResult.stream``).
    Returns the results by index and the run's start and end (``time.time()`` seconds)."""
    timeout = httpx.Timeout(args.timeout_s, connect=10)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    url = args.base_url + "/v1/completions"
    results: dict[int, RequestResult] = {}
    fields = request_fields(getattr(args, "schema", None))
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.time()))
        start = time.time()
        if request_rate:
            rng = random.Random(seed)

            async def delayed(i: int, prompt: list[int], max_tokens: int, delay: float) -> None:
                await asyncio.sleep(delay)
                results[i] = await run_one(client, url, model, prompt, max_tokens, fields)

            arrivals, t = [], 0.0
            for _ in items:
                arrivals.append(t)
                t += rng.expovariate(request_rate)
            await asyncio.gather(*(delayed(*item, a) for item, a in zip(items, arrivals)))
        else:
            pending = list(items)

            async def client_loop(k: int) -> None:
                while pending:
                    i, prompt, max_tokens = pending.pop(0)
                    results[i] = await run_one(client, url, model, prompt, max_tokens, fields)
                    results[i].stream = stream_base + k

            await asyncio.gather(*(client_loop(k) for k in range(concurrency)))
    return results, start, time.time()


def _drive_shard(args: argparse.Namespace, model: str, items: list, concurrency: int,
                 request_rate: float | None, seed: int, start_at: float,
                 stream_base: int = 0) -> tuple:  # fmt: skip
    """One client process of ``--num-clients``: :func:`drive` on its share."""
    return asyncio.run(
        drive(args, model, items, concurrency, request_rate, seed, start_at, stream_base)
    )


async def prepare(args: argparse.Namespace) -> tuple[str, list[tuple[list[int], int]]]:
    """The model name (asked from the server unless given), the timed prompts; sends the
    warm-up requests."""
    prompts = make_prompts(
        args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.vocab_size,
        args.seed,
    )  # fmt: skip
    # Warm-up prompts of their own (another seed): re-sending timed prompts would let a
    # server's prefix cache answer them, and their TTFT would not be a prefill's.
    warmup = make_prompts(
        args.warmup, args.input_len, args.output_len, args.range_ratio, args.vocab_size,
        args.seed + 1_000_003,
    )  # fmt: skip
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout_s, connect=10)) as client:
        model = args.model
        if model is None:
            model = (await client.get(args.base_url + "/v1/models")).json()["data"][0]["id"]
        for prompt, max_tokens in warmup:
            await run_one(
                client, args.base_url + "/v1/completions", model, prompt, max_tokens,
                request_fields(getattr(args, "schema", None)),
            )  # fmt: skip
    return model, prompts


def run_benchmark(
    args: argparse.Namespace,
) -> tuple[list[RequestResult], float, str, dict[str, float] | None]:
    """Warm up, then send every prompt from ``--num-clients`` client processes (the prompts
    dealt round-robin, the concurrency or the request rate split evenly: a sum of Poisson
    processes is one at the summed rate); returns the results in prompt order, the run's
    seconds (first start to last end), the model name and the server's counters after the
    warm-up (:func:`server_counters`)."""
    model, prompts = asyncio.run(prepare(args))
    before = server_counters(args.base_url)
    items = [(i, p, m) for i, (p, m) in enumerate(prompts)]
    n = args.num_clients
    if n == 1:
        results, start, end = asyncio.run(
            drive(args, model, items, args.concurrency, args.request_rate, args.seed + 1)
        )
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        rate = args.request_rate / n if args.request_rate else None
        start_at = time.time() + 3.0  # the client processes start (import httpx) before this
        counts = [args.concurrency // n + (k < args.concurrency % n) for k in range(n)]
        shares = [
            (args, model, items[k::n], counts[k], rate, args.seed + 1 + k, start_at,
             sum(counts[:k]))
            for k in range(n)
        ]  # fmt: skip
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(n, mp_context=ctx) as pool:
            parts = list(pool.map(_drive_shard, *zip(*shares)))
        results = {i: r for part, _, _ in parts for i, r in part.items()}
        start, end = min(p[1] for p in parts), max(p[2] for p in parts)
    return [results[i] for i in range(len(prompts))], end - start, model, before


def server_counters(base_url: str) -> dict[str, float] | None:
    """This project's engine counters from ``base_url + "/metrics"``: ``steps:<mode>`` per graph
    mode and ``generation_tokens``; None when the server has no such metrics (another engine, a
    router) or cannot be reached. Parsed with ``prometheus_client``'s text parser."""
    try:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(base_url + "/metrics", timeout=10).text
        counters: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "fastdeploy:steps_total":
                    counters[f"steps:{sample.labels.get('mode', '?')}"] = sample.value
                elif sample.name == "fastdeploy:generation_tokens_total":
                    counters["generation_tokens"] = sample.value
    except (ImportError, httpx.HTTPError, ValueError):
        return None
    return counters if "generation_tokens" in counters else None


def step_summary(
    before: dict[str, float] | None, after: dict[str, float] | None, seconds: float
) -> dict | None:
    """Engine steps during the run from two :func:`server_counters` readings: ``steps`` by
    mode, ``tokens_per_step`` (output tokens per step) and ``ms_per_step`` (run seconds per
    step, idle time included); None without both readings."""
    if before is None or after is None:
        return None
    steps = {
        key.split(":", 1)[1]: int(after[key] - before.get(key, 0.0))
        for key in after
        if key.startswith("steps:")
    }
    total = sum(steps.values())
    tokens = after["generation_tokens"] - before["generation_tokens"]
    return {
        "steps": steps,
        "tokens_per_step": tokens / total if total else 0.0,
        "ms_per_step": seconds * 1000 / total if total else 0.0,
    }


def percentiles(values: list[float]) -> dict[str, float]:
    """Mean, p50, p95 and p99 of ``values`` in milliseconds (zeros when empty)."""
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p95": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))] * 1000

    return {"mean": statistics.fmean(values) * 1000, "p50": pct(50), "p95": pct(95), "p99": pct(99)}


def check_outputs(results: list[RequestResult], checker: SchemaChecker) -> None:
    """Set ``schema_valid`` on each completed request from its kept text."""
    for r in results:
        if r.error is None:
            r.schema_valid = checker.valid(r.text or "")


def summarize(results: list[RequestResult], seconds: float) -> dict:
    """The run's throughput and latency summary (latencies in ms). ``cached_prompt_tokens`` is
    the sum of the completed requests' prompt tokens from the server's prefix cache, None when
    none of them carried the count (a server that does not report it). ``output_tokens`` are
    the tokens actually generated (under a schema often fewer than asked), ``finish_reasons``
    counts the completed requests by finish reason, and ``schema_valid`` is the number of
    completed outputs the schema accepted (:func:`check_outputs`; None without a schema)."""
    ok = [r for r in results if r.error is None]
    out_tokens = sum(r.output_len for r in ok)
    finish: dict[str, int] = {}
    for r in ok:
        finish[str(r.finish_reason)] = finish.get(str(r.finish_reason), 0) + 1
    checked = [r.schema_valid for r in ok if r.schema_valid is not None]
    in_tokens = sum(r.prompt_len for r in ok)
    reported = any(r.cached_tokens_reported for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "seconds": seconds,
        "request_throughput": len(ok) / seconds,
        "output_throughput": out_tokens / seconds,
        "total_token_throughput": (in_tokens + out_tokens) / seconds,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "mean_output_tokens": out_tokens / len(ok) if ok else 0.0,
        "finish_reasons": dict(sorted(finish.items())),
        "schema_valid": sum(checked) if checked else None,
        "schema_checked": len(checked),
        "cached_prompt_tokens": sum(r.cached_tokens for r in ok) if reported else None,
        "ttft_ms": percentiles([r.ttft for r in ok]),
        "tpot_ms": percentiles(tpot),
        "itl_ms": percentiles([gap for r in ok for gap in r.itl]),
        "e2e_ms": percentiles([r.e2e for r in ok]),
    }


def print_table(summary: dict, args: argparse.Namespace, model: str) -> None:
    load = f"rate {args.request_rate}/s" if args.request_rate else f"concurrency {args.concurrency}"
    print(
        f"\nServing benchmark | {args.base_url} | model {model} | {args.num_prompts} prompts, "
        f"input {args.input_len}, max output {args.output_len}, range ratio {args.range_ratio} | "
        f"{load} | {args.num_clients} client process(es)"
        + (f" | --json-schema {args.json_schema}" if args.json_schema else "")
    )
    done, failed, seconds = summary["completed"], summary["failed"], summary["seconds"]
    print(f"completed {done}, failed {failed} in {seconds:.2f} s")
    for e in summary["errors"]:
        print(f"  error: {e}")
    print(
        f"throughput: {summary['request_throughput']:.2f} req/s, "
        f"{summary['output_throughput']:.1f} output tok/s, "
        f"{summary['total_token_throughput']:.1f} total tok/s"
    )
    reasons = ", ".join(f"{k} {v}" for k, v in summary["finish_reasons"].items())
    print(
        f"output tokens: {summary['output_tokens']} generated, "
        f"{summary['mean_output_tokens']:.1f} per request (asked {args.output_len}); "
        f"finish: {reasons or 'none'}"
    )
    if summary.get("schema_valid") is not None:
        print(
            f"schema-valid: {summary['schema_valid']}/{summary['schema_checked']} "
            f"(checked with {summary['schema_check']})"
        )
    print(f"{'metric (ms)':<12} {'mean':>9} {'p50':>9} {'p95':>9} {'p99':>9}")
    for name in ("ttft", "tpot", "itl", "e2e"):
        p = summary[f"{name}_ms"]
        print(
            f"{name.upper():<12} {p['mean']:9.2f} {p['p50']:9.2f} {p['p95']:9.2f} {p['p99']:9.2f}"
        )
    print_prefix_cache(summary)
    steps = summary.get("engine_steps")
    if steps:
        modes = ", ".join(f"{mode} {n}" for mode, n in sorted(steps["steps"].items()) if n)
        print(
            f"engine steps during the run (server /metrics): {modes or 'none'}; "
            f"{steps['tokens_per_step']:.1f} output tokens/step, {steps['ms_per_step']:.3f} ms/step"
        )


def print_prefix_cache(summary: dict) -> None:
    """The prompt tokens the server's prefix cache served, when the server reported them, and
    a warning when there were any: TTFT then measured cache hits, not prefills."""
    cached, total = summary.get("cached_prompt_tokens"), summary["input_tokens"]
    if cached is None:
        return
    share = 100 * cached / total if total else 0.0
    print(f"prompt tokens from the server's prefix cache: {cached} of {total} ({share:.1f}%)")
    if cached > 0:
        print(
            "warning: TTFT includes prefix-cache hits (prompts sent before, same --seed); for "
            "prefill TTFT use another --seed or turn prefix caching off on the server"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="default: the server's first model")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--range-ratio", type=float, default=0.0)
    parser.add_argument("--vocab-size", type=int, default=32000, help="prompt ids < this")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, default=16)
    load.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per s")
    parser.add_argument(
        "--warmup", type=int, default=2,
        help="requests sent before timing, with prompts of their own (never timed prompts)",
    )  # fmt: skip
    parser.add_argument(
        "--num-clients", type=int, default=1,
        help="client processes sharing the load: one Python client spends about 70 us of CPU "
        "per streamed chunk, so at tens of thousands of tokens/s one process is the bottleneck",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--json", default=None, help="also write the summary to this file")
    parser.add_argument(
        "--json-schema", "--json-schema-path", default=None, metavar="PATH_OR_JSON",
        help="constrain every request to this JSON schema (a file, or inline JSON starting "
        "with '{'; 'default' is benchmarks/bench_schema.json) through response_format, and "
        "count the outputs it accepts ('schema-valid: k/N'); outputs may end before "
        "--output-len where the grammar ends",
    )  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.num_prompts < 1 or args.concurrency < 1 or not 0 <= args.range_ratio < 1:
        raise SystemExit("--num-prompts and --concurrency must be >= 1, --range-ratio in [0, 1)")
    if not 1 <= args.num_clients <= min(args.num_prompts, args.concurrency):
        raise SystemExit(
            f"--num-clients={args.num_clients} is invalid; allowed: 1..min(--num-prompts, "
            f"--concurrency) = {min(args.num_prompts, args.concurrency)}"
        )
    args.schema, checker = None, None
    if args.json_schema is not None:
        value = str(DEFAULT_SCHEMA) if args.json_schema == "default" else args.json_schema
        args.schema = load_json_schema(value)
        checker = SchemaChecker(args.schema)
    results, seconds, model, before = run_benchmark(args)
    if checker is not None:
        check_outputs(results, checker)
    summary = summarize(results, seconds)
    summary["schema_check"] = checker.method if checker else None
    summary["engine_steps"] = step_summary(before, server_counters(args.base_url), seconds)
    print_table(summary, args, model)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"args": vars(args), "summary": summary, "results": [asdict(r) for r in results]}
            )
        )
    return summary


if __name__ == "__main__":
    main()
