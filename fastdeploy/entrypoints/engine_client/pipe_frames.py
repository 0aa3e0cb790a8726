"""Read ``multiprocessing.Connection`` messages from a non-blocking pipe, resuming partial ones.

The server's event loop reads the engine's messages when the pipe is readable
(``loop.add_reader``). ``Connection.recv`` assumes a blocking descriptor: a message larger than
the pipe's buffer (64 KiB on Linux; a step message for ~300 outputs) arrives in pieces, and a
``recv`` on a non-blocking descriptor (uvloop makes a reader's descriptor non-blocking) raised
``BlockingIOError`` half way through, which the reader took for the engine's death (issue 43).

:class:`FrameReader` reads whatever bytes are there, keeps the rest of a message for the next
wake-up, and returns only whole messages. Why this and not a reader thread with blocking reads:
a thread would take the GIL from the asyncio thread for every step (up to the 5 ms switch
interval while it encodes streams) and then hand every message over; the event loop already
knows when the pipe is readable.

The wire format is ``Connection.send``'s (CPython ``multiprocessing/connection.py``,
``_send_bytes``): a signed big-endian 4-byte length, or ``-1`` followed by an unsigned 8-byte
length for payloads over 2 GiB, then the pickle. The sending side stays ``Connection.send``.
"""

from __future__ import annotations

import os
import pickle
import struct
from typing import Any

#: Bytes asked of ``os.read`` at a time.
READ_CHUNK = 1 << 20


class FrameReader:
    """Whole messages from a pipe's descriptor, however the bytes arrive.

    Args:
        fd: the receiving end's descriptor (``Connection.fileno()``); made non-blocking here.

    The caller owns the descriptor: closing it is the ``Connection``'s business.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        os.set_blocking(fd, False)
        self._buf = bytearray()

    def read(self) -> tuple[list[Any], bool]:
        """Read what the pipe holds now.

        Returns:
            ``(messages, eof)``: the unpickled messages completed by this read, in order, and
            whether the writer has closed its end (end-of-file). A partial message stays
            buffered; it is never an error.

        Raises:
            OSError: a read error other than "no data now" (``EAGAIN``), e.g. ``EBADF`` after
                the descriptor was closed.
            pickle.UnpicklingError (or what ``pickle.loads`` raises): a corrupt message.
        """
        eof = False
        while True:
            try:
                chunk = os.read(self.fd, READ_CHUNK)
            except BlockingIOError:
                break
            except InterruptedError:
                continue
            if not chunk:
                eof = True
                break
            self._buf += chunk
            if len(chunk) < READ_CHUNK:
                break  # drained for now: let the loop come back when more arrives
        return self._messages(), eof

    def _messages(self) -> list[Any]:
        out = []
        view = self._buf
        pos = 0
        while True:
            if len(view) - pos < 4:
                break
            (size,) = struct.unpack_from("!i", view, pos)
            head = 4
            if size == -1:
                if len(view) - pos < 12:
                    break
                (size,) = struct.unpack_from("!Q", view, pos + 4)
                head = 12
            if len(view) - pos - head < size:
                break
            start = pos + head
            out.append(pickle.loads(bytes(view[start : start + size])))
            pos = start + size
        if pos:
            del self._buf[:pos]
        return out

    @property
    def pending_bytes(self) -> int:
        """Bytes of a message not yet complete."""
        return len(self._buf)
