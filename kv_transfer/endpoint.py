"""The transfer backend as the KVManager sees it: one small Protocol and a registry of backends.

    endpoint = make_endpoint(backend, role, kv_tensors, aux_tensor, faults)
    endpoint.metadata() / add_peer(meta) / remove_peer(name)     peers (agents) by name
    xfer = endpoint.post_write(local, remote, mem_type, peer, nbytes)   one WRITE of many descriptors
    endpoint.is_done(xfer) / release(xfer) / progress() / close()

Only the KVManager's background thread calls an endpoint after construction. A failing
call raises EndpointError (`terminal`: the backend reported the transfer ended, so no byte
of it lands later; `injected`: a FaultInjector fault, the peer connection is fine).
A second backend (Mooncake, a test fake) implements TransferEndpoint and registers a
factory here, or is handed to KVManagerArgs.endpoint_factory; manager.py does not change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np
    import torch

    from kv_transfer.faults import FaultInjector

TRANSFER_BACKENDS = ("nixl",)


class EndpointError(RuntimeError):
    def __init__(self, message: str, *, injected: bool = False, terminal: bool = False) -> None:
        super().__init__(message)
        self.injected = injected
        self.terminal = terminal


@dataclass
class PostedXfer:
    handle: Any
    nbytes: int
    ndescs: int
    rank: int = 0  # TP rank whose agent posted it (> 0: through kv_transfer/rank_link.py)
    posted_at: float = 0.0  # time.monotonic() when posting began (post -> done starts here)
    post_s: float = 0.0  # time spent building and posting it (descriptor lists, initialize, transfer)
    is_aux: bool = False  # the aux row's WRITE: timed, but not counted as KV bandwidth


class TransferEndpoint(Protocol):
    name: str  # this agent's unique name (peers address it by name)
    kv_mem_type: str  # "DRAM" | "VRAM": where the registered KV buffers live
    kv_device: int
    aux_base: int  # address of the registered aux buffer (0: none registered)

    def metadata(self) -> bytes: ...
    def add_peer(self, metadata: bytes) -> str: ...
    def remove_peer(self, name: str) -> None: ...
    def post_write(self, local: np.ndarray, remote: np.ndarray, mem_type: str, peer: str, nbytes: int) -> PostedXfer: ...
    def is_done(self, xfer: PostedXfer, *, inject: bool = True) -> bool: ...
    def release(self, xfer: PostedXfer) -> None: ...
    def progress(self) -> None: ...
    def close(self) -> None: ...


# (role, KV tensors, aux tensor or None: a TP rank > 0 moves KV only, faults)
EndpointFactory = Callable[[str, "list[torch.Tensor]", "torch.Tensor | None", "FaultInjector"], TransferEndpoint]


def make_endpoint(
    backend: str, role: str, kv_tensors: list[torch.Tensor], aux_tensor: torch.Tensor | None, faults: FaultInjector
) -> TransferEndpoint:
    """The endpoint of a registered backend (imported only when used)."""
    if backend == "nixl":
        from kv_transfer.nixl_endpoint import NixlEndpoint

        return NixlEndpoint(role, kv_tensors, aux_tensor, faults)
    raise ValueError(f"unknown KV transfer backend {backend!r}; available: {', '.join(TRANSFER_BACKENDS)}")
