"""The ``tcp`` KV transport: the stdlib fallback where NIXL is missing (CPU CI, minimal hosts).

The prefill node serves reads of its registered KV caches; the decode node pulls the blocks it
lacks and scatters them into its own blocks. On the wire, after a one-line JSON request
``{"block_ids": [...]}`` and a one-line JSON answer ``{"ok": true, "num_layers": L,
"block_bytes": B}``, come ``L`` frames, one per layer in order, each the raw bytes of
``kv_caches[layer][block_ids]`` (``len(block_ids) * B`` bytes). On CUDA the blocks go through host
memory on both sides. Where both engines use the same layout (the decode node checks the layout
fingerprint first), ``B`` is equal on both sides; a mismatch fails the pull.

The engine never sees this class's internals: a pull is a :class:`Transfer` it polls.

The server reads only what it may: at most one pool's worth of ids per request, each a real
block, and (on a prefill node, :attr:`TcpKVTransport.authorize`) only blocks held for a transfer
a decode node has CLAIMed, so a stray or hostile client cannot read other requests' KV or make
the server gather gigabytes. NIXL reads registered memory directly and has no such hook.

With a PD secret, the request line is signed like a side-channel message (purpose ``kv-read``,
:mod:`~fastdeploy.splitwise.pd_auth`) and the server verifies it before it looks at a block id.
The KV bytes themselves are neither signed nor encrypted. The server serves at most
``max_connections`` connections at once, gives a client :data:`REQUEST_DEADLINE_S` to send its
request line, and closes a connection on which a read or write makes no progress for
:data:`IO_TIMEOUT_S`.
"""

from __future__ import annotations

import json
import logging
import socket
import socketserver
import threading
import time
from collections.abc import Callable

import torch

from fastdeploy.splitwise.capped_server import MAX_CONNECTIONS, CappedTCPServer
from fastdeploy.splitwise.pd_auth import AuthError, PDAuth
from fastdeploy.splitwise.transport import Transfer, block_bytes, start_pull_thread

logger = logging.getLogger(__name__)

#: Longest request line accepted by the server (bytes).
MAX_LINE_BYTES = 1 << 20
#: Seconds a client has, from connecting, to send its whole request line.
REQUEST_DEADLINE_S = 10.0
#: Seconds one socket read or write on the server may make no progress.
IO_TIMEOUT_S = 30.0
#: The ``purpose`` KV reads are signed for (:meth:`PDAuth.sign`).
PURPOSE = "kv-read"


def _gather(kv_cache: torch.Tensor, block_ids: list[int]) -> bytes:
    """The bytes of ``kv_cache[block_ids]`` (through host memory on CUDA)."""
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    blocks = kv_cache.index_select(0, index).contiguous().cpu()
    return blocks.view(torch.uint8).numpy().tobytes()


def _until(sock: socket.socket, deadline: float) -> None:
    """Give the next blocking call on ``sock`` only what is left before ``deadline``
    (``time.monotonic()``): a per-call timeout alone would let a peer that trickles bytes hold a
    pull forever.

    Raises:
        TimeoutError: the deadline has passed.
    """
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the pull did not finish within its deadline")
    sock.settimeout(left)


def _recv_exact(sock: socket.socket, buffer: memoryview, deadline: float) -> None:
    got = 0
    while got < len(buffer):
        _until(sock, deadline)
        n = sock.recv_into(buffer[got:])
        if n == 0:
            raise ConnectionError(f"the peer closed the connection after {got} of {len(buffer)} B")
        got += n


class TcpKVTransport:
    """Serves reads of this engine's KV caches and pulls a peer's blocks into them.

    Args:
        host: address the server binds and advertises (``127.0.0.1`` on one host).
        port: TCP port of the block server (0: a free one).
        auth: signs this node's reads and verifies its peers'; None: unauthenticated.
        max_connections: connections the server serves at once (more are refused, counted in
            :attr:`refused_connections`).
    """

    name = "tcp"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        auth: PDAuth | None = None,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.host = host
        self._requested_port = port
        self.auth = auth
        self.max_connections = max_connections
        self.kv_caches: list[torch.Tensor] = []
        self._server: CappedTCPServer | None = None
        self.port = 0
        #: ``authorize(block_ids) -> bool``: whether a read of these blocks is allowed now (the
        #: prefill role: they belong to claimed pending sends); None allows any valid block.
        self.authorize: Callable[[list[int]], bool] | None = None

    # ------------------------------------------------------------------ prefill side
    def register(self, kv_caches: list[torch.Tensor]) -> None:
        """Register the KV caches (one tensor per layer, ``[num_blocks, ...]``) once, and start
        serving reads of them.

        Raises:
            OSError: the port cannot be bound.
        """
        self.kv_caches = kv_caches
        transport = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                try:
                    transport._serve(self.request)
                except OSError:  # a timeout, or the peer reset the connection
                    pass

        self._server = CappedTCPServer(
            (self.host, self._requested_port), Handler, self.max_connections, "PD KV port"
        )
        self.port = self._server.server_address[1]
        threading.Thread(
            target=self._server.serve_forever, name="kv-tcp-transport", daemon=True
        ).start()

    def local_metadata(self) -> dict:
        """What a peer needs to pull from here (goes into ``kv_transfer_params``)."""
        return {"transport": self.name, "host": self.host, "port": self.port}

    @property
    def refused_connections(self) -> int:
        """Connections refused for being over ``max_connections``."""
        return self._server.refused if self._server is not None else 0

    def _serve(self, conn: socket.socket) -> None:
        try:
            request = json.loads(_read_request_line(conn))
            if not isinstance(request, dict):
                raise ValueError("the request must be a JSON object")
            if self.auth is not None:
                self.auth.verify(PURPOSE, request)
            ids = request["block_ids"]
            num_blocks = self.kv_caches[0].shape[0]
            if not isinstance(ids, list) or len(ids) > num_blocks:
                raise ValueError(f"block_ids must be a list of at most {num_blocks} ids")
            if not all(type(b) is int and 0 < b < num_blocks for b in ids):
                raise ValueError(f"block_ids outside 1..{num_blocks - 1}: {ids[:16]}")
            if self.authorize is not None and not self.authorize(ids):
                raise ValueError("block_ids are not held for a claimed transfer")
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            if isinstance(e, AuthError):
                n = self.auth.rejected.get(e.reason, 0)
                if n & (n - 1) == 0:  # the 1st, 2nd, 4th, ... of a reason: no log flood
                    logger.warning("PD KV port refused a read (%d so far): %s", n, e)
            conn.sendall((json.dumps({"ok": False, "error": str(e)}) + "\n").encode())
            return
        header = {"ok": True, "num_layers": len(self.kv_caches)}
        header["block_bytes"] = block_bytes(self.kv_caches[0])
        conn.sendall((json.dumps(header) + "\n").encode())
        for kv in self.kv_caches:
            conn.sendall(_gather(kv, ids))

    def close(self) -> None:
        """Stop serving reads."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # ------------------------------------------------------------------ decode side
    def start_pull(
        self,
        request_id: str,
        remote: dict,
        remote_block_ids: list[int],
        local_block_ids: list[int],
        timeout_s: float = 60.0,
    ) -> Transfer:
        """Pull ``remote_block_ids`` of the peer described by ``remote`` (its
        :meth:`local_metadata`) into ``local_block_ids`` of the registered caches, on a thread.
        ``timeout_s`` is the whole pull's deadline, not a limit per socket call: a peer that
        trickles bytes fails it too.

        Raises:
            ValueError: the two id lists differ in length, or nothing is registered.
        """
        return start_pull_thread(
            self._pull,
            self.kv_caches,
            request_id,
            remote,
            remote_block_ids,
            local_block_ids,
            timeout_s,
        )

    def _pull(self, transfer, remote, remote_ids, local_ids, timeout_s) -> None:
        start = time.monotonic()
        deadline = start + timeout_s  # for the whole pull, not for each socket call
        error = None
        try:
            with socket.create_connection((remote["host"], remote["port"]), timeout_s) as sock:
                transfer._cancel_hook = lambda: _shutdown(sock)
                if transfer._cancelled:
                    raise ConnectionError("cancelled")
                request = {"block_ids": remote_ids}
                if self.auth is not None:
                    request = self.auth.sign(PURPOSE, request)
                _until(sock, deadline)
                sock.sendall((json.dumps(request) + "\n").encode())
                header = json.loads(_read_line(sock, deadline))
                if not header.get("ok"):
                    raise ConnectionError(f"the peer refused: {header.get('error')}")
                self._receive(sock, header, local_ids, transfer, deadline)
        except (OSError, ValueError, KeyError) as e:
            error = f"{type(e).__name__}: {e}"
        transfer.finish(error, time.monotonic() - start)

    def _receive(
        self, sock, header: dict, local_ids: list[int], transfer: Transfer, deadline: float
    ) -> None:
        local_bytes = block_bytes(self.kv_caches[0])
        if header["num_layers"] != len(self.kv_caches) or header["block_bytes"] != local_bytes:
            raise ValueError(
                f"layout mismatch: peer has {header['num_layers']} layers of "
                f"{header['block_bytes']} B blocks, here {len(self.kv_caches)} of {local_bytes} B"
            )
        n = len(local_ids)
        index = torch.tensor(local_ids, dtype=torch.long)
        for kv in self.kv_caches:
            staging = torch.empty((n, *kv.shape[1:]), dtype=kv.dtype)
            _recv_exact(sock, memoryview(staging.view(torch.uint8).numpy()).cast("B"), deadline)
            transfer.num_bytes += n * local_bytes
            kv.index_copy_(0, index.to(kv.device), staging.to(kv.device))
        if kv.is_cuda:
            torch.cuda.current_stream(kv.device).synchronize()


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _read_request_line(conn: socket.socket) -> bytes:
    """The client's request line, which must arrive whole within :data:`REQUEST_DEADLINE_S`
    (a client trickling bytes cannot hold a thread longer) and within :data:`MAX_LINE_BYTES`.

    Raises:
        ValueError: too long. OSError: the deadline passed (``TimeoutError``) or the peer left.
    """
    deadline = time.monotonic() + REQUEST_DEADLINE_S
    out = bytearray()
    while b"\n" not in out:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no request line within {REQUEST_DEADLINE_S:g} s")
        conn.settimeout(min(left, IO_TIMEOUT_S))
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("the client closed the connection before its request")
        out += chunk
        if len(out) > MAX_LINE_BYTES:
            raise ValueError(f"request line longer than {MAX_LINE_BYTES} bytes")
    conn.settimeout(IO_TIMEOUT_S)  # for the frames: a reader that stops reading is dropped
    return bytes(out)


def _read_line(sock: socket.socket, deadline: float) -> bytes:
    """One ``\\n``-terminated line, read byte by byte so no frame byte is consumed, before
    ``deadline``."""
    out = bytearray()
    while not out.endswith(b"\n"):
        _until(sock, deadline)
        chunk = sock.recv(1)
        if not chunk:
            raise ConnectionError("the peer closed the connection before answering")
        out += chunk
        if len(out) > MAX_LINE_BYTES:
            raise ValueError("answer line too long")
    return bytes(out)
