"""A role, composed: what build_engine_core assembles for a colocated, prefill or decode engine.

    role = RoleSpec(name, radix_cache, defer_frees, needs_bootstrap, build)
    core = build_engine_core(args, output, role=role)
      -> KV memory with role.radix_cache / role.defer_frees applied
      -> role.build(SchedulerParts(...)) -> RoleEngine(scheduler, transfer)

Every field is consumed by build_engine_core or the engine loop; there is no method a role
overrides that a caller may forget to call. A PD role's build makes its transfer manager
over the pool it is handed and passes it to its scheduler's constructor; the loop polls,
health-checks and shuts down that manager through the RoleEngine's TransferLink.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from common.scheduler.config import SchedulerConfig
from common.scheduler.executor import Executor
from common.scheduler.kv_manager import ReqKVManager
from common.scheduler.scheduler import OutputSink, Scheduler

if TYPE_CHECKING:
    from common.cache.kv_pool import KVPool

RoleName = Literal["colocated", "prefill", "decode"]


@dataclass(frozen=True)
class SchedulerParts:
    """What build_engine_core made, handed to a role's build: the role's scheduler owns none of
    it except its queues; the pool and executor stay the EngineCore's."""

    cfg: SchedulerConfig
    executor: Executor
    kv: ReqKVManager
    kv_pool: KVPool
    future_capacity: int
    output: OutputSink
    kv_link: str = ""  # TP > 1: where ranks 1..N-1's KV transfer agents connect (kv_transfer/rank_link.py)


class TransferService(Protocol):
    """A PD role's KV transfer manager as the engine loop sees it (kv_transfer.KVManager)."""

    def health(self) -> str | None: ...
    def shutdown(self) -> None: ...


@dataclass(frozen=True)
class TransferLink:
    """The transfer beside a PD scheduler: `poll` runs every loop iteration before the step
    (moves requests between the role's transfer queues), `service` answers health and is shut
    down after the engine."""

    service: TransferService
    poll: Callable[[], None]
    bootstrap_port: int | None = None  # prefill: where decode instances reach it


@dataclass(frozen=True)
class RoleEngine:
    scheduler: Scheduler
    transfer: TransferLink | None = None


@dataclass(frozen=True)
class RoleSpec:
    name: RoleName
    radix_cache: bool  # False: the role never keeps a prefix cache, whatever --disable-radix-cache says
    # True: a finished request's pages are freed only once the step in flight has completed
    # (decode: a NIXL write into a reused page is not ordered behind that step)
    defer_frees: bool
    needs_bootstrap: bool  # requests must carry BootstrapInfo (PD roles)
    build: Callable[[SchedulerParts], RoleEngine]
    # a request without BootstrapInfo is prefilled here instead (decode with its prefix cache:
    # the router sends it a prompt whose uncached suffix is short)
    local_prefill: bool = False


def _build_colocated(parts: SchedulerParts) -> RoleEngine:
    return RoleEngine(
        Scheduler(parts.cfg, parts.executor, parts.kv, future_capacity=parts.future_capacity, output=parts.output)
    )


COLOCATED = RoleSpec("colocated", radix_cache=True, defer_frees=False, needs_bootstrap=False, build=_build_colocated)
