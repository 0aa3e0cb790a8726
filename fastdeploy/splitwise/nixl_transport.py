"""The ``nixl`` KV transport: NIXL (UCX backend) reads a peer's KV blocks straight into ours.

API of the PyPI package ``nixl`` 1.5 (https://github.com/ai-dynamo/nixl). The KV caches are
registered once; a pull is one READ of descriptor pairs, one pair per layer and run of blocks
consecutive on both sides (``merge_block_runs``), since the descriptor count, not the bytes, is
what makes block transfers slow. The peer's agent metadata travels base64-encoded in its
:meth:`NixlKVTransport.local_metadata` (inside ``kv_transfer_params``) and is added once per peer.
The engine never sees NIXL types: it polls a :class:`~fastdeploy.splitwise.transport.Transfer`.
"""

from __future__ import annotations

import base64
import logging
import threading
import time

import torch

from fastdeploy.cache_manager.block_runs import merge_block_runs
from fastdeploy.splitwise.transport import Transfer, block_bytes, start_pull_thread

logger = logging.getLogger(__name__)

#: Seconds between polls of a READ's state on the transfer's thread.
POLL_S = 0.0005


class NixlKVTransport:
    """KV transfer through a NIXL agent with the UCX backend.

    Args:
        name: the agent name, unique per engine (peers address it by that name).
        host: the address this node advertises (informational; UCX finds its own route).

    Raises:
        ImportError: nixl is not installed.
    """

    name = "nixl"

    def __init__(self, name: str, host: str = "127.0.0.1") -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.agent_name = name
        self.host = host
        self.agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
        self.kv_caches: list[torch.Tensor] = []
        self._known: set[str] = set()
        self._lock = threading.Lock()  # the agent is shared by the transfer threads

    def register(self, kv_caches: list[torch.Tensor]) -> None:
        """Register the KV caches (one contiguous ``[num_blocks, ...]`` tensor per layer) once."""
        for kv in kv_caches:
            if not kv.is_contiguous():
                raise ValueError("KV caches must be contiguous to be registered with NIXL")
            self.agent.register_memory(kv)
        self.kv_caches = kv_caches

    def local_metadata(self) -> dict:
        """What a peer needs to read from here: agent name and metadata, layer base addresses,
        block bytes, memory kind and device."""
        kv = self.kv_caches[0]
        return {
            "transport": self.name,
            "agent": self.agent_name,
            "agent_metadata": base64.b64encode(self.agent.get_agent_metadata()).decode(),
            "base_addrs": [t.data_ptr() for t in self.kv_caches],
            "block_bytes": block_bytes(kv),
            "mem_type": "VRAM" if kv.is_cuda else "DRAM",
            "device_id": kv.device.index or 0,
        }

    def start_pull(
        self,
        request_id: str,
        remote: dict,
        remote_block_ids: list[int],
        local_block_ids: list[int],
        timeout_s: float = 60.0,
    ) -> Transfer:
        """READ ``remote_block_ids`` of ``remote`` (a peer's :meth:`local_metadata`) into
        ``local_block_ids`` of every layer; a thread watches the READ until it ends.

        Raises:
            ValueError: id lists of different lengths, nothing registered, or a layout that
                differs from the peer's (layers, block bytes).
        """
        if self.kv_caches:
            size = block_bytes(self.kv_caches[0])
            layers = len(self.kv_caches)
            if remote["block_bytes"] != size or len(remote["base_addrs"]) != layers:
                raise ValueError(
                    f"layout mismatch: peer has {len(remote['base_addrs'])} layers of "
                    f"{remote['block_bytes']} B blocks, here {layers} of {size} B"
                )
        return start_pull_thread(
            self._pull,
            self.kv_caches,
            request_id,
            remote,
            remote_block_ids,
            local_block_ids,
            timeout_s,
        )

    def _descs(self, remote: dict, remote_ids: list[int], local_ids: list[int]):
        size = block_bytes(self.kv_caches[0])
        kv = self.kv_caches[0]
        local_dev = kv.device.index or 0
        local, far = [], []
        for r, loc, n in merge_block_runs(remote_ids, local_ids):
            for layer, base in enumerate(remote["base_addrs"]):
                far.append((base + r * size, n * size, remote["device_id"]))
                local.append((self.kv_caches[layer].data_ptr() + loc * size, n * size, local_dev))
        local_type = "VRAM" if kv.is_cuda else "DRAM"
        return (
            self.agent.get_xfer_descs(local, local_type),
            self.agent.get_xfer_descs(far, remote["mem_type"]),
        )

    def _pull(self, transfer, remote, remote_ids, local_ids, timeout_s) -> None:
        start = time.monotonic()
        error, handle = None, None
        try:
            with self._lock:
                if remote["agent"] not in self._known:
                    self.agent.add_remote_agent(base64.b64decode(remote["agent_metadata"]))
                    self._known.add(remote["agent"])
                local, far = self._descs(remote, remote_ids, local_ids)
                handle = self.agent.initialize_xfer("READ", local, far, remote["agent"])
                state = self.agent.transfer(handle)
            deadline = start + timeout_s
            while state not in ("DONE", "ERR"):
                if transfer._cancelled:
                    raise TimeoutError("cancelled")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the READ did not finish within {timeout_s:g} s")
                time.sleep(POLL_S)
                with self._lock:
                    state = self.agent.check_xfer_state(handle)
            if state == "ERR":
                raise ConnectionError("NIXL reported an error (the peer may be gone)")
            transfer.num_bytes = (
                len(remote_ids) * block_bytes(self.kv_caches[0]) * len(self.kv_caches)
            )
        except Exception as e:  # noqa: BLE001 - nixl raises its own types; report any as failure
            error = f"{type(e).__name__}: {e}"
        finally:
            if handle is not None:
                with self._lock:
                    try:
                        # Releasing a READ in flight aborts it; NIXL waits for the abort, so no
                        # late write lands after this returns.
                        self.agent.release_xfer_handle(handle)
                    except Exception as e:  # noqa: BLE001
                        error = error or f"release failed: {e}"
        transfer.finish(error, time.monotonic() - start)

    def close(self) -> None:
        """Forget the peers (the agent is released with this object)."""
        for name in list(self._known):
            try:
                self.agent.remove_remote_agent(name)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
        self._known.clear()
