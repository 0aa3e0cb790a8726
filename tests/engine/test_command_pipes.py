"""PipeCommands: the engine process's commands, read from the API servers' pipes on the loop's
own thread (no receiving thread that would wait for the GIL)."""

from __future__ import annotations

import multiprocessing
import queue
import threading
import time

import pytest

from fastdeploy.engine import command_pipes
from fastdeploy.engine.command_pipes import PipeCommands
from fastdeploy.engine.engine_loop import AbortRequest, StopLoop, Wake


def drain(commands: PipeCommands) -> list:
    got = []
    while True:
        try:
            got.append(commands.get_nowait())
        except queue.Empty:
            return got


def test_commands_come_in_order_and_a_closed_pipe_stops_the_loop():
    recv, send = multiprocessing.Pipe(duplex=False)
    commands = PipeCommands([recv])
    assert drain(commands) == []
    send.send(AbortRequest("a"))
    send.send(AbortRequest("b"))
    commands.put(Wake())  # from a thread of the engine process
    # The queue's command was put before the pipe was read: the pipe's follow it.
    assert drain(commands) == [Wake(), AbortRequest("a"), AbortRequest("b")]
    send.send(AbortRequest("c"))
    send.close()
    assert drain(commands) == [AbortRequest("c"), StopLoop()]
    assert drain(commands) == []  # the closed pipe is not read again
    commands.close()


def test_an_idle_loop_waits_for_a_pipe_or_a_put_and_times_out_without_either():
    recv, send = multiprocessing.Pipe(duplex=False)
    commands = PipeCommands([recv])
    start = time.monotonic()
    with pytest.raises(queue.Empty):
        commands.get(timeout=0.05)
    assert time.monotonic() - start >= 0.04
    threading.Timer(0.05, send.send, [AbortRequest("x")]).start()
    assert commands.get(timeout=10) == AbortRequest("x")
    threading.Timer(0.05, commands.put, [Wake()]).start()
    assert commands.get(timeout=10) == Wake()
    # Many puts with nobody waiting fill the wake pipe; nothing blocks, nothing is lost.
    for _ in range(100_000):
        commands.put(Wake())
    assert len(drain(commands)) == 100_000
    with pytest.raises(queue.Empty):  # the stale wake-ups cost one empty wait at most
        commands.get(timeout=0.01)
    with pytest.raises(queue.Empty):
        commands.get(timeout=0.01)
    commands.close()
    commands.put(Wake())  # after close: queued, no error


def test_each_pipe_goes_to_its_route():
    pipes = [multiprocessing.Pipe(duplex=False) for _ in range(2)]
    commands = PipeCommands([recv for recv, _ in pipes])
    routed: list[list] = [[], []]
    commands.set_routes([routed[0].append, routed[1].append])
    pipes[1][1].send(AbortRequest("b"))
    pipes[1][1].close()
    pipes[0][1].send(AbortRequest("a"))
    assert drain(commands) == []  # routes put into the queue themselves (a router does)
    assert routed == [[AbortRequest("a")], [AbortRequest("b"), StopLoop()]]
    with pytest.raises(ValueError, match="1 route"):
        PipeCommands([recv for recv, _ in pipes]).set_routes([print])
    with pytest.raises(ValueError, match="at least one pipe"):
        PipeCommands([])


def test_a_pipe_closing_before_the_engine_is_ready_ends_the_process(monkeypatch):
    exits = []

    def fake_exit(code):
        exits.append(code)

    monkeypatch.setattr(command_pipes.os, "_exit", fake_exit)
    recv, send = multiprocessing.Pipe(duplex=False)
    commands = PipeCommands([recv])
    ready = threading.Event()
    watcher = commands.watch_until_ready(ready)
    send.send(AbortRequest("r"))  # a command before ready is kept
    send.close()
    watcher.join(10)
    assert not watcher.is_alive() and exits == [1]
    assert drain(commands) == [AbortRequest("r"), StopLoop()]  # (the process would be gone)


def test_the_watcher_stops_once_ready_and_leaves_the_pipe_to_the_loop():
    recv, send = multiprocessing.Pipe(duplex=False)
    commands = PipeCommands([recv])
    ready = threading.Event()
    watcher = commands.watch_until_ready(ready)
    ready.set()
    watcher.join(10)
    assert not watcher.is_alive()
    send.send(AbortRequest("r"))
    assert commands.get(timeout=10) == AbortRequest("r")
