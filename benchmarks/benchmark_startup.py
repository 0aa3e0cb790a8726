"""Start-up as a user sees it (issue #47): start ``fastdeploy serve`` and print, from the moment
the process was started, the time until

* the weights were loaded (the server's ``loaded ...`` log line, timestamped as it arrives),
* ``/health`` answered 200,
* the first token of a streamed request sent at once (retried until the port accepts it),
* every CUDA graph was captured (``/v1/server_info``'s ``stats.graph_capture.done``; ``n/a``
  without graphs),

and the mean time per output token of a decode stream while graphs were being captured against
one after (the issue's bound: at most 2x). One command::

    python benchmarks/benchmark_startup.py                       # the default GGUF
    python benchmarks/benchmark_startup.py --serve-args "--model /path/llama3-8b \\
        --load-format dummy --skip-tokenizer-init --max-model-len 4096"
    python benchmarks/benchmark_startup.py --serve-args "... --graph-optimization-config \\
        '{\\"capture_in_background\\": false}'"   # today's blocking capture, to compare

The server runs in a session of its own and is stopped (SIGTERM, then SIGKILL) on every exit.
A JSON line with every number ends the output (``--json`` prints only that).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

import httpx

DEFAULT_SERVE_ARGS = "--max-model-len 2048"
#: Log lines whose first arrival is timestamped (name -> regular expression).
LOG_MARKS = {
    "weights_loaded": re.compile(r"\bloaded \S+: \d+ layers"),
    "kv_allocated": re.compile(r"KV cache: \d+ blocks x"),
    "serving_before_capture": re.compile(r"serving before capture"),
    "engine_ready": re.compile(r"engine process \d+ is ready"),
    "http_started": re.compile(r"engine loop started"),
    "capture_done": re.compile(r"background capture done|captured \d+ CUDA graphs"),
}
#: The request's prompt, as token ids: it works with and without a tokenizer (dummy weights
#: serve with ``--skip-tokenizer-init``, and then stream ``token_ids`` instead of text).
PROMPT_IDS = list(range(1000, 1032))


@dataclass
class Startup:
    """Seconds from the process start (None: never seen); see the module docstring."""

    weights_loaded: float | None = None
    kv_allocated: float | None = None
    serving_before_capture: float | None = None
    engine_ready: float | None = None
    http_started: float | None = None
    health: float | None = None
    first_token: float | None = None
    all_captured: float | None = None
    capture_done_log: float | None = None
    graphs: dict | None = None
    tpot_during_capture_ms: float | None = None
    tpot_after_capture_ms: float | None = None
    #: With ``--compare-blocking``: the seconds a server started with capture_in_background
    #: false spent capturing before serving (its ``graph_capture.seconds``).
    blocking_capture_s: float | None = None
    marks: dict = field(default_factory=dict)

    @property
    def background_capture_wall_s(self) -> float | None:
        """Seconds from "serving before capture" to "background capture done" (both log lines
        of the server, timestamped as they arrived); None unless both were seen."""
        if self.serving_before_capture is None or self.capture_done_log is None:
            return None
        return round(self.capture_done_log - self.serving_before_capture, 3)

    def checks(self) -> list[tuple[str, bool | None]]:
        """The issue's done-when items that this run can judge (None: cannot tell)."""

        def ok(cond, *needed):
            return None if any(v is None for v in needed) else bool(cond())

        return [
            (
                "first token <= 2 s after the weights are ready",
                ok(lambda: self.first_token - self.weights_loaded <= 2.0,
                   self.first_token, self.weights_loaded),
            ),
            (
                "/health ready before capture ends",
                ok(lambda: self.health < self.all_captured, self.health, self.all_captured),
            ),
            (
                "background capture done within 1.2x of the blocking capture",
                ok(lambda: self.background_capture_wall_s <= 1.2 * self.blocking_capture_s,
                   self.background_capture_wall_s, self.blocking_capture_s),
            ),
            (
                "decode TPOT during capture <= 2x steady state",
                ok(lambda: self.tpot_during_capture_ms <= 2 * self.tpot_after_capture_ms,
                   self.tpot_during_capture_ms, self.tpot_after_capture_ms),
            ),
        ]  # fmt: skip


def mark_log_lines(lines, t0: float, marks: dict, clock=time.monotonic) -> None:
    """Read ``lines`` (the server's output) to the end, echo them to stderr, and record in
    ``marks`` the first time (seconds after ``t0``) each pattern of :data:`LOG_MARKS` shows."""
    for line in lines:
        now = clock() - t0
        sys.stderr.write(line)
        for name, pattern in LOG_MARKS.items():
            if name not in marks and pattern.search(line):
                marks[name] = round(now, 3)


def stream_token_times(url: str, max_tokens: int, deadline: float) -> list[float]:
    """Send one streamed completion (retrying while the port refuses it or the server answers
    503) and return the ``time.monotonic()`` of every chunk that carries text (or token ids,
    from a server without a tokenizer)."""
    body = {"prompt": PROMPT_IDS, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    while time.monotonic() < deadline:
        try:
            times = []
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
                if r.status_code == 503:
                    time.sleep(0.05)
                    continue
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunk = json.loads(line[6:])
                        choice = (chunk.get("choices") or [{}])[0]
                        if choice.get("text") or choice.get("token_ids"):
                            times.append(time.monotonic())
            return times
        except httpx.TransportError:
            time.sleep(0.02)
    raise TimeoutError("no answer to the request sent at start")


def capture_over(stats: dict) -> bool:
    """Whether ``/v1/server_info``'s ``stats`` say there is no capture left: every graph done,
    or an engine that reported stats without ``graph_capture`` (no graphs). Empty stats (the
    engine process has not reported yet, right after ``/health``) say nothing: False."""
    graphs = stats.get("graph_capture")
    return bool(stats) and (graphs is None or bool(graphs.get("done")))


def mean_gap_ms(times: list[float]) -> float | None:
    """Mean gap between consecutive token times, in ms (None under two tokens)."""
    if len(times) < 2:
        return None
    return 1000 * (times[-1] - times[0]) / (len(times) - 1)


def split_tpot(times: list[float], boundary: float | None) -> tuple[float | None, float | None]:
    """Mean TPOT (ms) of the gaps that ended before ``boundary`` (capture done, monotonic) and
    of those after it (all before when ``boundary`` is None)."""
    if boundary is None:
        return mean_gap_ms(times), None
    before = [t for t in times if t <= boundary]
    after = [t for t in times if t > boundary]
    return mean_gap_ms(before), mean_gap_ms(after)


def with_blocking_capture(serve_args: str) -> str:
    """``serve_args`` with ``capture_in_background`` false in its
    ``--graph-optimization-config`` (added to the JSON given there, or a new flag)."""
    args = shlex.split(serve_args)
    flag = "--graph-optimization-config"
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            args[i + 1] = json.dumps({**json.loads(args[i + 1]), "capture_in_background": False})
            return shlex.join(args)
        if arg.startswith(flag + "="):
            given = json.loads(arg.split("=", 1)[1])
            args[i] = f"{flag}={json.dumps({**given, 'capture_in_background': False})}"
            return shlex.join(args)
    return shlex.join([*args, flag, json.dumps({"capture_in_background": False})])


def run(serve_args: str, max_tokens: int, timeout_s: float) -> Startup:
    """Start the server, measure (module docstring), stop it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "fastdeploy.entrypoints.cli.main", "serve", "--host",
           "127.0.0.1", "--port", str(port), *shlex.split(serve_args)]  # fmt: skip
    result = Startup()
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    reader = threading.Thread(
        target=mark_log_lines, args=(proc.stdout, t0, result.marks), daemon=True
    )
    reader.start()
    tokens: list[float] = []
    errors: list[BaseException] = []

    def client():
        try:
            tokens.extend(stream_token_times(url, max_tokens, deadline))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    first = threading.Thread(target=client, daemon=True)
    first.start()  # the request sent at once
    captured_at = None
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}: {shlex.join(cmd)}")
            now = time.monotonic()
            try:
                if (
                    result.health is None
                    and httpx.get(f"{url}/health", timeout=1).status_code == 200
                ):
                    result.health = round(now - t0, 3)
                if result.health is not None:
                    info = httpx.get(f"{url}/v1/server_info", timeout=5).json()
                    stats = info.get("stats") or {}
                    graphs = stats.get("graph_capture")
                    result.graphs = graphs
                    if capture_over(stats):
                        captured_at = now if graphs is not None else None
                        result.all_captured = round(now - t0, 3) if graphs is not None else None
                        break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        first.join(timeout=max(deadline - time.monotonic(), 1))
        if errors:
            raise errors[0]
        if tokens:
            result.first_token = round(tokens[0] - t0, 3)
        if captured_at is not None:  # a second stream, after capture: steady state
            during, _ = split_tpot(tokens, captured_at)
            result.tpot_during_capture_ms = during
            result.tpot_after_capture_ms = mean_gap_ms(
                stream_token_times(url, max_tokens, deadline)
            )
        else:
            result.tpot_after_capture_ms = mean_gap_ms(tokens)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        except ProcessLookupError:
            pass
        reader.join(timeout=5)
    for name in (
        "weights_loaded", "kv_allocated", "serving_before_capture", "engine_ready", "http_started"
    ):  # fmt: skip
        setattr(result, name, result.marks.get(name))
    result.capture_done_log = result.marks.get("capture_done")
    return result


def report(r: Startup) -> str:
    """The printed table."""

    def s(v):
        return "n/a" if v is None else f"{v:.2f} s"

    def ms(v):
        return "n/a" if v is None else f"{v:.2f} ms"

    g = r.graphs or {}
    lines = [
        f"weights loaded          {s(r.weights_loaded)}",
        f"KV cache allocated      {s(r.kv_allocated)}",
        f"engine process ready    {s(r.engine_ready)}",
        f"HTTP server started     {s(r.http_started)}",
        f"/health ready           {s(r.health)}",
        f"first token (sent at 0) {s(r.first_token)}",
        f"all graphs captured     {s(r.all_captured)}"
        + (f"  ({g.get('captured')}/{g.get('total')}, {g.get('failed')} failed, "
           f"{g.get('seconds')} s capturing, background={g.get('background')})" if g else ""),
        f"capture wall (bg)       {s(r.background_capture_wall_s)}"
        f"  (capturing {s(g.get('seconds') if g.get('background') else None)})"
        f"  vs blocking capture {s(r.blocking_capture_s)}",
        f"TPOT during capture     {ms(r.tpot_during_capture_ms)}",
        f"TPOT after capture      {ms(r.tpot_after_capture_ms)}",
    ]  # fmt: skip
    for name, ok in r.checks():
        lines.append(f"{'n/a ' if ok is None else 'PASS' if ok else 'FAIL'}  {name}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--serve-args",
        default=DEFAULT_SERVE_ARGS,
        help=f"arguments of fastdeploy serve (default: {DEFAULT_SERVE_ARGS!r})",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=256,
        help="tokens of the request sent at start (default: 256)",
    )
    p.add_argument("--timeout", type=float, default=900, help="seconds (default: 900)")
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    p.add_argument(
        "--compare-blocking",
        action="store_true",
        help="then start the server again with capture_in_background false and judge the "
        "background capture's wall time against that blocking capture's (at most 1.2x)",
    )
    args = p.parse_args(argv)  # fmt: skip
    result = run(args.serve_args, args.max_tokens, args.timeout)
    if args.compare_blocking:
        blocking = run(with_blocking_capture(args.serve_args), args.max_tokens, args.timeout)
        result.blocking_capture_s = (blocking.graphs or {}).get("seconds")
        if not args.json:
            print("-- blocking capture (capture_in_background false) --")
            print(report(blocking))
            print("-- background capture --")
    if not args.json:
        print(report(result))
    print(
        json.dumps(
            {**asdict(result), "background_capture_wall_s": result.background_capture_wall_s}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
