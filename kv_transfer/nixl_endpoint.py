"""One NIXL agent (UCX, progress thread OFF) with the KV and aux buffers registered once.

Only the KVManager's background thread calls into it after construction. Every NIXL
call that can fail raises NixlError with the original message: a dead peer makes
check_xfer_state raise (nixlRemoteDisconnectError), not return "ERR".
"""

from __future__ import annotations

import os
import secrets
import socket
import time

import numpy as np
import torch
from nixl._api import nixl_agent, nixl_agent_config

from kv_transfer.endpoint import EndpointError, PostedXfer
from kv_transfer.faults import FaultInjector, InjectedFault

NixlError = EndpointError  # every failing NIXL call raises it, with NIXL's own message


def unique_agent_name(role: str) -> str:
    """Unique per process start: a restarted peer never inherits old notifications."""
    return f"{role}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


def mem_type_of(tensor: torch.Tensor) -> tuple[str, int]:
    if tensor.device.type == "cpu":
        return "DRAM", 0
    return "VRAM", tensor.device.index or 0


class NixlEndpoint:
    """The NIXL (UCX) implementation of kv_transfer.endpoint.TransferEndpoint."""

    def __init__(
        self, role: str, kv_tensors: list[torch.Tensor], aux_tensor: torch.Tensor | None, faults: FaultInjector
    ) -> None:
        tensors = [*kv_tensors, *([] if aux_tensor is None else [aux_tensor])]
        for t in tensors:
            if not t.is_contiguous():
                raise ValueError("NIXL needs contiguous buffers")
        self.name = unique_agent_name(role)
        self.faults = faults
        self.agent = nixl_agent(self.name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.kv_mem_type, self.kv_device = mem_type_of(kv_tensors[0]) if kv_tensors else ("DRAM", 0)
        self._reg = []
        if kv_tensors:
            self._reg.append(self.agent.register_memory(kv_tensors))
        if aux_tensor is not None:
            self._reg.append(self.agent.register_memory(aux_tensor))
        self.aux_base = 0 if aux_tensor is None else aux_tensor.data_ptr()

    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def add_peer(self, metadata: bytes) -> str:
        try:
            return self.agent.add_remote_agent(metadata)
        except Exception as e:
            raise NixlError(f"add_remote_agent failed: {e}") from e

    def remove_peer(self, name: str) -> None:
        try:
            self.agent.remove_remote_agent(name)
        except Exception:
            pass  # already gone: nothing to clean

    def post_write(self, local: np.ndarray, remote: np.ndarray, mem_type: str, peer: str, nbytes: int) -> PostedXfer:
        handle = None
        start = time.monotonic()
        try:
            self.faults.before_post()
            ldescs = self.agent.get_xfer_descs(local, mem_type)
            rdescs = self.agent.get_xfer_descs(remote, mem_type)
            handle = self.agent.initialize_xfer("WRITE", ldescs, rdescs, peer)
            state = self.agent.transfer(handle)
        except Exception as e:
            if handle is not None:
                self.release(PostedXfer(handle, 0, 0))
            raise NixlError(f"posting WRITE to {peer} failed: {e}", injected=isinstance(e, InjectedFault)) from e
        if state == "ERR":
            self.release(PostedXfer(handle, 0, 0))
            raise NixlError(f"posting WRITE to {peer} returned ERR")
        # post -> done starts when posting starts: a backend may move bytes inside transfer()
        # (UCX over CMA copies there), which must count as transfer time, not be hidden
        return PostedXfer(handle, nbytes, len(local), posted_at=start, post_s=time.monotonic() - start)

    def is_done(self, xfer: PostedXfer, *, inject: bool = True) -> bool:
        """DONE means the writes are complete at the target (NIXL flushes before DONE).
        inject=False: the real state only (a room already failed waits for its writes)."""
        try:
            if inject:
                self.faults.at_poll()
            state = self.agent.check_xfer_state(xfer.handle)
            if inject and state != "ERR" and self.faults.holding():
                return False
        except Exception as e:
            raise NixlError(f"transfer failed: {e}", injected=isinstance(e, InjectedFault)) from e
        if state == "ERR":
            raise NixlError("transfer failed: state ERR", terminal=True)
        return state == "DONE"

    def release(self, xfer: PostedXfer) -> None:
        try:
            self.agent.release_xfer_handle(xfer.handle)
        except Exception:
            pass  # NIXL could not cancel it; nothing more we can do

    def progress(self) -> None:
        """Drive the UCX worker as a target (the progress thread is off)."""
        try:
            self.agent.get_new_notifs()
        except Exception:
            pass

    def close(self) -> None:
        for reg in self._reg:
            try:
                self.agent.deregister_memory(reg)
            except Exception:
                pass
        self._reg.clear()
