"""The KV transfer contract: poll states, failure causes, configuration, manager arguments.

Who owns what:
- The scheduler (prefill or decode) owns the KV pool pages and the aux slots; it lends
  their ids to a KVSender / KVReceiver and takes them back when poll() is terminal
  (decode: only when `receiver.pages_releasable()`).
- The KVManager owns the NIXL agent, the registrations of the KV and aux buffers, the
  control socket and the one background thread that does all I/O.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

    from common.cache.kv_pool import KVLayout
    from common.cluster_secret import ClusterSecret
    from kv_transfer.aux_buffer import AuxBuffer
    from kv_transfer.endpoint import EndpointFactory


class KVPoll(enum.IntEnum):
    """Ordered so that min() over ranks gives the most pessimistic state. Failed is terminal."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


def min_poll(states: Iterable[KVPoll]) -> KVPoll:
    """MIN-reduction across ranks (TP=1 today: one state in, the same out)."""
    return min(states)


class FailureCause(str, enum.Enum):
    """Label of the failures metric; a reason string always goes with it."""

    BOOTSTRAP_TIMEOUT = "bootstrap_timeout"
    HANDSHAKE = "handshake"
    LAYOUT_MISMATCH = "layout_mismatch"
    TRANSFER_TIMEOUT = "transfer_timeout"
    TRANSFER_ERROR = "transfer_error"
    PEER_LOST = "peer_lost"
    ABORTED = "aborted"
    DUPLICATE_ROOM = "duplicate_room"
    BAD_REQUEST = "bad_request"
    CORRUPTION = "corruption"
    SHUTDOWN = "shutdown"


class KVTransferError(RuntimeError):
    """A misuse of the API by its caller (raised at once, in the caller's thread)."""


@dataclass(frozen=True)
class TransferConfig:
    """Every timeout and knob of kv_transfer, in one place. Defaults:

    - bootstrap_timeout_s = 300: prefill fails a sender whose decode sent no page ids for this
      long after its creation or decode's last mention of the room in a Ping (decode lists the
      rooms its prealloc queue holds, at every ping: a long wait for decode memory is no lost decode).
    - handshake_timeout_s = 10: decode fails the rooms of a prefill that does not answer
      its registration.
    - transfer_timeout_s = 300: decode fails a receiver that got no status message and
      no sign of life of its room (prefill's Pong names the rooms it still looks after) this
      long after init() or the last such sign. On prefill: how long its engine may leave a
      room unpolled (a long forward, a hang) before the room's sign of life stops; a room
      with WRITEs outstanding and none completing for heartbeat_timeout_s has none either.
    - engine_watch_timeout_s = None: prefill, how long its engine may leave a live room unpolled
      (the engine polls every room each loop iteration) before it counts as hung: the room's
      sign of life stops and prefill fails it, so decode hears at once. The prefill instance
      passes its --watchdog-timeout (a phase longer than that is a hang there too); None:
      max(heartbeat_timeout_s, transfer_timeout_s).
    - heartbeat_interval_s = 5, heartbeat_timeout_s = 15: decode pings every prefill it
      uses; silence for the timeout fails all that prefill's rooms. Prefill likewise fails
      the rooms of a decode it has not heard from for the timeout.
    - drain_timeout_s = 30: decode holds an aborted/failed receiver's pages until prefill
      confirms its writes drained, or this long.
    - settle_timeout_s = 5: prefill waits this long for the handles of a failed transfer
      (siblings, and one whose poll raised without NIXL reporting ERR: its writes may
      still land) before reporting the failure anyway.
    - idle_poll_s = 0.05, busy_poll_s = 0.001: the background thread's poller timeout
      when nothing / something is in flight (ZMQ polls in whole ms).
    - shutdown_timeout_s = 5: bound on KVManager.shutdown().
    - stall_report_s = 10: KVManager.health() reports the thread stuck when one iteration
      of its loop (normally <= idle_poll_s) takes longer than this.
    - send_hwm = 10000: ZMQ high-water mark; sends past it are dropped, never blocked.
    - Bounds on what peers can make prefill hold (every message on the bootstrap port):
      max_msg_bytes = 8 MiB (ZMQ MAXMSGSIZE: a larger message drops its connection),
      max_peers = 256 registered decodes, max_early_requests = 1024 TransferRequests
      waiting for their sender (and per decode no more pages than its pool declared),
      max_tombstones = 4096 remembered failed rooms (oldest forgotten first),
      max_reason_chars = 256 of an Abort's reason.
    - faults = "": fault-injection spec (see kv_transfer.faults.FaultSpec), tests only.
    """

    bootstrap_timeout_s: float = 300.0
    handshake_timeout_s: float = 10.0
    transfer_timeout_s: float = 300.0
    engine_watch_timeout_s: float | None = None
    heartbeat_interval_s: float = 5.0
    heartbeat_timeout_s: float = 15.0
    drain_timeout_s: float = 30.0
    settle_timeout_s: float = 5.0
    idle_poll_s: float = 0.05
    busy_poll_s: float = 0.001
    shutdown_timeout_s: float = 5.0
    stall_report_s: float = 10.0
    send_hwm: int = 10000
    max_msg_bytes: int = 8 << 20
    max_peers: int = 256
    max_early_requests: int = 1024
    max_tombstones: int = 4096
    max_reason_chars: int = 256
    faults: str = ""

    @property
    def engine_bound_s(self) -> float:
        """See engine_watch_timeout_s."""
        if self.engine_watch_timeout_s is not None:
            return self.engine_watch_timeout_s
        return max(self.heartbeat_timeout_s, self.transfer_timeout_s)

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            if name.endswith("_s") and value is not None and not value > 0:
                raise ValueError(f"TransferConfig.{name} must be > 0, got {value}")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("TransferConfig.heartbeat_timeout_s must exceed heartbeat_interval_s")


@dataclass
class KVManagerArgs:
    """What one engine hands its KVManager. The tensors stay owned by the engine's pool;
    the manager only registers them (once) and reads/writes them through NIXL."""

    role: Literal["prefill", "decode"]
    layout: KVLayout
    kv_buffer: torch.Tensor  # the page-major KV pool (KVPool.kv): registered once, one descriptor per page run
    aux_buffer: AuxBuffer
    bootstrap_host: str = "127.0.0.1"  # the instance's --host: prefill's bootstrap port, and UCX's interface (both roles)
    bootstrap_port: int = 0  # prefill: 0 picks a free port (see KVManager.bootstrap_port)
    rank: int = 0
    config: TransferConfig = field(default_factory=TransferConfig)
    registry: object | None = None  # prometheus_client.CollectorRegistry; None = a private one
    backend: str = "nixl"  # one of kv_transfer.endpoint.TRANSFER_BACKENDS
    endpoint_factory: EndpointFactory | None = None  # overrides `backend` (tests, out-of-tree backends)
    cluster_secret: ClusterSecret | None = None  # bootstrap channel over CURVE (common.zmq_curve); None: plain
    kv_head_start: int = 0  # first KV head of kv_buffer (TP rank 0: 0)
    tp_size: int = 1  # > 1: this is rank 0; ranks 1..N-1 run a RankAgent each (kv_transfer/rank_agent.py)
    tp_link: str = ""  # where those agents connect (ipc://); TP 1: unused


class StateCell:
    """A poll state shared by the scheduler thread and the manager thread.

    Failed is terminal; otherwise a state only moves forward (max of old and new)."""

    __slots__ = ("_changed", "_state", "reason", "cause")

    def __init__(self, state: KVPoll = KVPoll.Bootstrapping) -> None:
        self._changed = threading.Condition(threading.Lock())
        self._state = state
        self.reason: str | None = None
        self.cause: FailureCause | None = None

    @property
    def state(self) -> KVPoll:
        return self._state

    def advance(self, new: KVPoll) -> bool:
        with self._changed:
            if self._state == KVPoll.Failed or new <= self._state:
                return False
            self._state = new
            self._changed.notify_all()
            return True

    def fail(self, cause: FailureCause, reason: str) -> bool:
        """True when this call moved the state to Failed (first failure wins)."""
        with self._changed:
            if self._state in (KVPoll.Failed, KVPoll.Success):
                return False
            self._state = KVPoll.Failed
            self.cause = cause
            self.reason = reason
            self._changed.notify_all()
            return True

    def wait(self, at_least: KVPoll, timeout_s: float) -> KVPoll:
        """Block until the state is Failed or >= `at_least`, at most `timeout_s`; the state then.
        For callers that have nothing else to do (tools, benchmarks); schedulers poll()."""
        with self._changed:
            self._changed.wait_for(lambda: self._state == KVPoll.Failed or self._state >= at_least, timeout_s)
            return self._state
