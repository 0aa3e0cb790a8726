"""FrameReader: whole messages from a non-blocking pipe, however the bytes arrive (issue 43)."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import struct
import threading

from fastdeploy.entrypoints.engine_client.pipe_frames import FrameReader


def test_a_message_larger_than_the_pipe_arrives_whole_over_several_reads():
    recv, send = multiprocessing.Pipe(duplex=False)
    reader = FrameReader(recv.fileno())
    big = ("step", [f"{i:06d}" + "x" * 100 for i in range(3000)])  # ~320 KB pickled: 5 pipes
    writer = threading.Thread(target=send.send, args=(big,))
    writer.start()
    got, reads = [], 0
    while not got:
        messages, eof = reader.read()
        assert not eof
        reads += 1
        got += messages
        if not got:
            threading.Event().wait(0.001)
    writer.join()
    assert got == [big]
    assert reads > 1, "the message should have needed more than one read"
    assert reader.pending_bytes == 0
    send.close()
    messages, eof = reader.read()
    assert messages == [] and eof
    recv.close()


def test_an_empty_pipe_is_no_message_and_no_end():
    recv, send = multiprocessing.Pipe(duplex=False)
    reader = FrameReader(recv.fileno())
    assert reader.read() == ([], False)
    send.send(1)
    send.send({"a": 2})
    assert reader.read() == ([1, {"a": 2}], False)
    send.close()
    recv.close()


def test_split_headers_and_the_long_length_form_are_read():
    r, w = os.pipe()
    reader = FrameReader(r)
    payload = pickle.dumps(("stats", {"n": 3}))
    frame = struct.pack("!i", len(payload)) + payload
    long_frame = struct.pack("!i", -1) + struct.pack("!Q", len(payload)) + payload
    data = frame + long_frame
    got = []
    for i in range(len(data)):  # one byte at a time: every split point of both headers
        os.write(w, data[i : i + 1])
        messages, eof = reader.read()
        assert not eof
        got += messages
    assert got == [("stats", {"n": 3})] * 2
    os.close(w)
    assert reader.read() == ([], True)
    os.close(r)
