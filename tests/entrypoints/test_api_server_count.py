"""``--api-server-count 3``: three API server processes in front of one engine process (CPU, the
default model, each server in a session of its own so that every process it starts is killed
when a test fails).

* every process answers alike, and ``/metrics`` from any of them counts the whole server;
* a killed API server process loses nothing: the engine aborts its requests (their KV blocks
  are freed), the others serve on;
* SIGTERM to the first process stops them all (exit 0); a killed first process takes the
  others and the engine with it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from http_server_utils import free_port, get_json, metric_samples, process_group_pids, wait_until

pytestmark = pytest.mark.slow

MODULE = [sys.executable, "-m", "fastdeploy.entrypoints.openai.api_server"]
STARTUP_TIMEOUT_S = 300
COUNT = 3
BODY = {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "temperature": 0}


def metrics_env(tmp_path: Path) -> dict[str, str]:
    """The environment with the server's Prometheus files under ``tmp_path``: a server killed
    with SIGKILL cannot remove the temporary directory it would make itself."""
    path = tmp_path / "metrics"
    path.mkdir(exist_ok=True)
    return {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(path)}


class Servers:
    """The server's first process (in its own session), logging to a file."""

    def __init__(self, tmp_path: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / "server.log"
        args = ["--host", "127.0.0.1", "--port", str(self.port), "--max-num-seqs", "8"]
        args += ["--max-model-len", "512", "--timeout-graceful-shutdown", "3"]
        args += ["--api-server-count", str(COUNT), *extra]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                MODULE + args,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=metrics_env(tmp_path),
            )
        try:
            wait_until(self.all_ready, STARTUP_TIMEOUT_S, "every API server process")
        except BaseException:
            self.kill()
            raise

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def all_ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()}")
        return self.log().count("Application startup complete") == COUNT

    def group(self) -> list[int]:
        """Pids still in the server's process group (its children included)."""
        return process_group_pids(self.proc.pid)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        for pid in self.group():  # children whose parent died first
            os.kill(pid, signal.SIGKILL)


def connected_to(url: str, index: int) -> tuple[httpx.Client, int]:
    """A keep-alive client whose connection is served by API server ``index``, and its pid."""
    for _ in range(200):
        client = httpx.Client(base_url=url, timeout=60)
        info = client.get("/v1/server_info").json()["api_server"]
        if info["index"] == index:
            return client, info["pid"]
        client.close()
    raise AssertionError(f"no connection reached API server {index} in 200 tries")


def idle(url: str) -> bool:
    info = get_json(url, "/v1/server_info")
    stats = info["stats"]
    return stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_cache_usage"] == 0


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    srv = Servers(tmp_path_factory.mktemp("api_server_count"))
    try:
        yield srv
    finally:
        srv.kill()


def test_every_process_answers_alike_and_metrics_count_the_whole_server(servers):
    texts = {}
    for index in range(COUNT):
        client, _ = connected_to(servers.url, index)
        try:
            r = client.post("/v1/completions", json={**BODY, "max_tokens": 6})
            assert r.status_code == 200, r.text
            texts[index] = r.json()["choices"][0]["text"]
            info = client.get("/v1/server_info").json()
            assert info["api_server"]["count"] == COUNT
            assert info["max_concurrency"] == 512 // COUNT + (1 if index < 512 % COUNT else 0)
        finally:
            client.close()
    assert len(set(texts.values())) == 1 and texts[0], texts
    samples = metric_samples(servers.url)
    assert samples[("fastdeploy:request_success_total", (("finished_reason", "length"),))] == 3
    assert samples[("fastdeploy:time_to_first_token_seconds_count", ())] == 3
    assert samples[("fastdeploy:generation_tokens_total", ())] == 18
    # The engine's counters come from the first process alone, not once per process.
    steps = sum(v for (name, _), v in samples.items() if name == "fastdeploy:steps_total")
    assert 6 <= steps <= 3 * 7, steps
    assert samples[("fastdeploy:num_total_kv_blocks", ())] > 0


def test_a_killed_api_server_process_loses_nothing_and_the_others_serve_on(servers):
    client, pid = connected_to(servers.url, COUNT - 1)
    ended = []

    def stream() -> None:
        body = {**BODY, "max_tokens": 400, "ignore_eos": True, "stream": True}
        try:
            with client.stream("POST", "/v1/completions", json=body) as r:
                for _ in r.iter_lines():
                    pass
            ended.append("finished")
        except httpx.HTTPError as e:
            ended.append(type(e).__name__)

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    wait_until(lambda: not idle(servers.url), 30, "the stream to run in the engine")
    os.kill(pid, signal.SIGKILL)
    thread.join(60)
    client.close()
    assert ended and ended[0] != "finished", ended
    wait_until(lambda: idle(servers.url), 30, "the engine to abort the dead process's request")
    assert f"API server {COUNT - 1} left; aborted its 1 request(s)" in servers.log()
    assert f"(pid {pid}) exited with code -9" in servers.log()
    for _ in range(6):  # whichever process answers
        r = httpx.post(servers.url + "/v1/completions", json={**BODY, "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text


def test_sigterm_to_the_first_process_stops_every_process(servers):
    servers.proc.send_signal(signal.SIGTERM)
    assert servers.proc.wait(60) == 0, servers.log()
    wait_until(lambda: not servers.group(), 20, "no process left in the server's group")
    log = servers.log()
    assert "engine loop stopped" in log and "stopped by SIGTERM" in log
    assert "Traceback" not in log, log


def test_a_killed_first_process_takes_the_others_and_the_engine_with_it(tmp_path):
    srv = Servers(tmp_path)
    try:
        others = [p for p in srv.group() if p != srv.proc.pid]
        assert len(others) >= COUNT  # the engine and COUNT - 1 API servers (and a tracker)
        os.kill(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait(10)
        wait_until(lambda: not srv.group(), 60, "the other processes to exit")
    finally:
        srv.kill()


def test_ctrl_c_right_after_the_engine_is_ready_stops_everything(tmp_path):
    """A Ctrl-C (SIGINT to the whole group) as the API server processes are being started: it
    used to leave the first process waiting at exit for an engine process that waited for it."""
    port = free_port()
    log_path = tmp_path / "server.log"
    args = ["--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", "8"]
    args += ["--max-model-len", "512", "--api-server-count", str(COUNT)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            MODULE + args,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=metrics_env(tmp_path),
            # as in a terminal (a non-interactive shell's background job ignores SIGINT)
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    try:
        wait_until(
            lambda: b"is ready" in log_path.read_bytes() or proc.poll() is not None,
            STARTUP_TIMEOUT_S,
            "the engine process",
        )
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(60) in (0, 130), log_path.read_text()
        wait_until(lambda: not process_group_pids(proc.pid), 20, "no process left")
        assert "Traceback" not in log_path.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for pid in process_group_pids(proc.pid):
            os.kill(pid, signal.SIGKILL)


def test_bad_counts_exit_2_naming_the_flag():
    for extra in (["--api-server-count", "0"], ["--api-server-count", "2",
                  "--disable-frontend-multiprocessing"]):  # fmt: skip
        out = subprocess.run(MODULE + extra, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and "--api-server-count=" in out.stderr, out.stderr
