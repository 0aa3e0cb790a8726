"""Our engine behind NVIDIA Dynamo 1.6 (``fastdeploy.integrations.dynamo``): etcd and NATS (with
JetStream), Dynamo's OpenAI frontend with its KV router, and two of our workers, all on 127.0.0.1
with the default model and a small KV pool; plus one plain ``fastdeploy serve`` to compare with.

Needs ``ai-dynamo`` (``pip install ai-dynamo==1.6.1``; its ``aisimulate`` dependency is not
needed) and Debian's ``etcd-server`` and ``nats-server`` (``.ci/run`` installs them); skipped,
saying which is missing, otherwise.
"""

from __future__ import annotations

import importlib.util
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "entrypoints"))
from http_server_utils import free_port, process_group_pids, wait_until  # noqa: E402
from server_process import serve  # noqa: E402

MISSING = [
    name
    for name, found in (
        ("the ai-dynamo package", importlib.util.find_spec("dynamo") is not None),
        ("etcd (Debian: etcd-server)", shutil.which("etcd") is not None),
        ("nats-server (Debian: nats-server)", shutil.which("nats-server") is not None),
    )
    if not found
]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(MISSING), reason=f"not installed: {', '.join(MISSING)}"),
]

MODEL = "SmolLM2-135M-Instruct"
#: Small KV pool per worker: 63 usable blocks of 64 tokens.
WORKER_FLAGS = ["--num-gpu-blocks-override", "64", "--max-model-len", "2048"]
STARTUP_TIMEOUT_S = 240
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def free_short_port() -> int:
    """A free port of 127.0.0.1 below 32768: Dynamo 1.6 reads ``DYN_SYSTEM_PORT`` as an i16
    ("invalid value unsigned int `55877`, expected i16 for key SYSTEM_PORT")."""
    for _ in range(200):
        port = random.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise AssertionError("no free port in 20000..32767")


def left_in_group(pgid: int, timeout_s: float = 15) -> list[str]:
    """The processes of group ``pgid`` still there after up to ``timeout_s`` seconds (an orphan
    needs a moment to be reaped), each as ``pid: command line``."""
    deadline = time.monotonic() + timeout_s
    while process_group_pids(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = []
    for pid in process_group_pids(pgid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue  # gone meanwhile
        left.append(f"{pid}: {cmd}")
    return left


class Proc:
    """A process in a session of its own, logging to ``log``; :meth:`kill` ends its group."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str]) -> None:
        self.name, self.log_path = name, log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
            )

    def log(self) -> str:
        return ANSI.sub("", self.log_path.read_text(errors="replace"))

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(
                f"{self.name} exited with {self.proc.returncode}:\n{self.log()[-4000:]}"
            )

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        for pid in process_group_pids(self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class Cluster:
    """etcd, NATS, the Dynamo frontend (KV router) and two workers; ``procs`` in start order."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.procs = tmp, []
        try:
            self._start_all()
        except BaseException:
            self.stop()  # what started before the failure
            raise

    def _start_all(self) -> None:
        etcd_port, peer_port, nats_port = free_port(), free_port(), free_port()
        self.env = {
            **os.environ,
            "ETCD_ENDPOINTS": f"http://127.0.0.1:{etcd_port}",
            "NATS_SERVER": f"nats://127.0.0.1:{nats_port}",
            "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": "0",  # drain at once on SIGTERM
            "ETCD_LEASE_TTL": "6",  # Dynamo's etcd lease: a killed worker is dropped sooner
            "PYTHONPATH": os.pathsep.join(
                [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]
            ),
        }
        self.start(
            "etcd",
            [
                "etcd",
                "--data-dir",
                str(self.tmp / "etcd"),
                "--listen-client-urls",
                self.env["ETCD_ENDPOINTS"],
                "--advertise-client-urls",
                self.env["ETCD_ENDPOINTS"],
                "--listen-peer-urls",
                f"http://127.0.0.1:{peer_port}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{peer_port}",
                "--initial-cluster",
                f"default=http://127.0.0.1:{peer_port}",
            ],
        )
        self.start(
            "nats",
            [
                "nats-server",
                "-js",
                "-a",
                "127.0.0.1",
                "-p",
                str(nats_port),
                "-sd",
                str(self.tmp / "jetstream"),
            ],
        )
        self.http_port = free_port()
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.frontend = self.start(
            "frontend",
            [
                sys.executable,
                "-m",
                "dynamo.frontend",
                "--router-mode",
                "kv",
                "--http-host",
                "127.0.0.1",
                "--http-port",
                str(self.http_port),
                "--event-plane",
                "nats",
            ],
            DYN_LOG="info,dynamo_llm::kv_router::routing_host=debug",  # its routing decisions
        )
        # One through the module, one through the CLI subcommand: the same worker.
        launchers = (
            ["-m", "fastdeploy.integrations.dynamo"],
            ["-m", "fastdeploy.entrypoints.cli.main", "dynamo-worker"],
        )
        # DYN_SYSTEM_PORT: each worker's Dynamo status server, whose /metrics shows the load
        # snapshots we send (KV blocks in use, pool size).
        self.system_ports = [free_short_port(), free_short_port()]
        self.workers = [
            self.start(
                f"worker{i}",
                [sys.executable, *launcher, "--event-plane", "nats", *WORKER_FLAGS],
                DYN_SYSTEM_PORT=str(port),
                TMPDIR=str(self.tmp),  # a killed worker's KV-event socket directory stays here
            )
            for i, (launcher, port) in enumerate(zip(launchers, self.system_ports))
        ]
        wait_until(
            self.ready,
            STARTUP_TIMEOUT_S,
            "the frontend to list the model and both workers to serve",
        )
        self.ids = {w.name: self.worker_id(w) for w in self.workers}

    def start(self, name: str, argv: list[str], **env: str) -> Proc:
        proc = Proc(name, argv, self.tmp / f"{name}.log", {**self.env, **env})
        self.procs.append(proc)
        return proc

    def ready(self) -> bool:
        for p in self.procs:
            p.check_alive()
        if not all("Serving " + MODEL in w.log() for w in self.workers):
            return False
        try:
            models = httpx.get(self.url + "/v1/models", timeout=5).json()["data"]
        except httpx.HTTPError:
            return False
        return any(m["id"] == MODEL for m in models)

    @staticmethod
    def worker_id(worker: Proc) -> str:
        """Dynamo's instance id of ``worker`` (its KV event publisher's log line)."""
        found = re.search(r"Initializing KvEventPublisher for worker (\d+)", worker.log())
        assert found, worker.log()[-3000:]
        return found.group(1)

    def chat(self, content: str, max_tokens: int = 16) -> dict:
        r = httpx.post(
            self.url + "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens,
                "temperature": 0,
            },
            timeout=120,
        )
        assert r.status_code == 200, r.text
        return r.json()

    def served_by(self, request_id: str) -> tuple[str, int]:
        """``(worker name, prompt tokens from its prefix cache)`` of a finished request, from the
        worker's log line."""
        uuid = request_id.removeprefix("chatcmpl-")
        pattern = re.compile(rf"request {uuid}: \d+ prompt tokens, (\d+) from the prefix cache")
        for w in self.workers:
            found = pattern.search(w.log())
            if found:
                return w.name, int(found.group(1))
        raise AssertionError(f"no worker logged request {uuid}")

    def router_choice(self, request_id: str) -> tuple[str, int, int]:
        """``(worker name, overlap blocks, prompt blocks)``: the worker Dynamo's KV router chose
        for ``request_id`` and the prefix blocks it knew that worker holds (from our KV events),
        from its debug line ``[ROUTING] Best: worker_<id> dp_rank=0 with N/M blocks overlap
        request_id=<id>``."""
        uuid = request_id.removeprefix("chatcmpl-")
        found = re.search(
            rf"\[ROUTING\] Best: worker_(\d+) dp_rank=\d+ with (\d+)/(\d+) blocks "
            rf"overlap request_id={uuid}",
            self.frontend.log(),
        )
        assert found, f"no routing decision for {uuid} in the frontend's log"
        name = {v: k for k, v in self.ids.items()}[found.group(1)]
        return name, int(found.group(2)), int(found.group(3))

    def kv_usage(self, index: int) -> tuple[float, int]:
        """``(KV cache usage 0..1, total KV blocks)`` of worker ``index`` as Dynamo reports it
        (``dynamo_component_gpu_cache_usage_percent``, ``dynamo_component_total_blocks``: the
        load snapshots our worker sends every 0.25 s)."""
        text = httpx.get(f"http://127.0.0.1:{self.system_ports[index]}/metrics", timeout=5).text
        values = {}
        for name in ("gpu_cache_usage_percent", "total_blocks"):
            found = re.search(rf"^dynamo_component_{name}{{[^}}]*}} (\S+)$", text, re.M)
            assert found, f"no dynamo_component_{name} in worker {index}'s /metrics"
            values[name] = float(found.group(1))
        return values["gpu_cache_usage_percent"], int(values["total_blocks"])

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.kill()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dynamo")
    c = Cluster(tmp)  # stops what it started when it fails
    try:
        yield c
    finally:
        c.stop()
        leftover = [p for g in (p.proc.pid for p in c.procs) for p in left_in_group(g)]
        assert not leftover, f"processes left: {leftover}"


def test_greedy_chat_through_dynamo_equals_our_server(cluster, tmp_path):
    prompt = "Name three primary colors."
    via_dynamo = cluster.chat(prompt, max_tokens=24)
    with serve(tmp_path, "--num-gpu-blocks-override", "64", "--max-model-len", "2048") as ours:
        r = httpx.post(
            ours.url + "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 24,
                "temperature": 0,
            },
            timeout=120,
        )
    assert r.status_code == 200, r.text
    direct = r.json()
    assert (
        via_dynamo["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    )
    assert via_dynamo["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]
    assert via_dynamo["usage"]["completion_tokens"] == direct["usage"]["completion_tokens"]
    assert via_dynamo["choices"][0]["finish_reason"] == direct["choices"][0]["finish_reason"]


def test_kv_router_sends_a_shared_prefix_to_the_worker_holding_it(cluster):
    # Three long prefixes (~9 blocks of 64 tokens each); the first request of each lands where
    # the router puts it; the second must go where the first left its blocks.
    prefixes = [" ".join(f"{topic}{i}" for i in range(150)) for topic in ("alpha", "beta", "gamma")]
    first = {p: cluster.chat(p + " Summarize.", max_tokens=2)["id"] for p in prefixes}
    time.sleep(1.0)  # the blocks' KV events reach the router
    for p in prefixes:
        holder, _ = cluster.served_by(first[p])
        assert cluster.router_choice(first[p])[:2] == (holder, 0)  # nothing cached anywhere yet
        second = cluster.chat(p + " Count them.", max_tokens=2)["id"]
        worker, cached = cluster.served_by(second)
        chosen, overlap, blocks = cluster.router_choice(second)
        assert chosen == worker == holder
        # The router knew 8 of the 9 prompt blocks were on that worker (our BlockStored events;
        # the 9th holds the differing question), and the worker's prefix cache served them.
        assert (overlap, blocks) == (8, 9)
        assert cached == 8 * 64, f"{worker} served {cached} cached prompt tokens"


def test_cancelled_stream_is_aborted_in_the_worker(cluster):
    with httpx.stream(
        "POST",
        cluster.url + "/v1/chat/completions",
        json={
            "model": MODEL,
            "stream": True,
            "max_tokens": 1000,
            "temperature": 0,
            "messages": [{"role": "user", "content": "Write a long story about a fox."}],
        },
        timeout=120,
    ) as r:
        assert r.status_code == 200
        # Read on until Dynamo shows one worker holding the request's blocks (from our load
        # snapshots, every 0.25 s), then hang up mid-stream.
        in_use = 0.0
        deadline = time.monotonic() + 30
        for line in r.iter_lines():
            if line.startswith("data: {"):
                in_use = sum(cluster.kv_usage(i)[0] for i in range(2))
                if in_use > 0 or time.monotonic() > deadline:
                    break
        assert in_use > 0, "no KV blocks in use while the request streamed"
    wait_until(
        lambda: any("aborted by Dynamo" in w.log() for w in cluster.workers),
        60,
        "a worker to abort the abandoned request",
    )
    # No KV block leaked: both pools are whole and empty again.
    wait_until(
        lambda: [cluster.kv_usage(i) for i in range(2)] == [(0.0, 63), (0.0, 63)],
        10,
        "every KV block free on both workers",
    )
    # The worker keeps serving after the abort.
    assert cluster.chat("Say hi.", max_tokens=4)["choices"][0]["message"]["content"]


def test_killing_one_worker_leaves_the_other_serving(cluster):
    victim, survivor = cluster.workers
    victim.kill()
    # Dynamo drops the dead worker once its etcd lease expires (requests routed to it before
    # that fail: the frontend's --migration-limit is 0 by default); wait for its decision.
    removed = f"Removing worker WorkerWithDpRank {{ worker_id: {cluster.ids[victim.name]},"
    wait_until(lambda: removed in cluster.frontend.log(), 90, "the frontend to drop the worker")
    replies = [cluster.chat("What is 2 + 2?", max_tokens=8) for _ in range(4)]
    assert {cluster.served_by(r["id"])[0] for r in replies} == {survivor.name}
    assert len({r["choices"][0]["message"]["content"] for r in replies}) == 1  # greedy
    # SIGTERM with a request in flight: Dynamo unregisters the worker and calls our cleanup,
    # which lets the request finish before the engine stops; then the process exits 0.
    in_flight: list[dict] = []
    admitted = survivor.log().count("prompt tokens admitted")
    thread = threading.Thread(
        target=lambda: in_flight.append(cluster.chat("Write a long story about a fox.", 32))
    )
    thread.start()
    wait_until(
        lambda: survivor.log().count("prompt tokens admitted") > admitted,
        30,
        "the request to run on the survivor",
    )
    survivor.proc.send_signal(signal.SIGTERM)
    thread.join(60)
    assert survivor.proc.wait(60) == 0, survivor.log()[-3000:]
    log = survivor.log()
    assert "Endpoint unregistered from discovery" in log and "draining 1 requests" in log
    assert in_flight and in_flight[0]["usage"]["completion_tokens"] > 0, in_flight
    assert in_flight[0]["choices"][0]["finish_reason"] in ("length", "stop")
    assert not left_in_group(survivor.proc.pid)
