"""The prefill role: PrefillScheduler + a KVManager that binds the bootstrap port.

Prefill keeps its radix cache (as configured) and frees pages at once: a page it frees is
never the target of a NIXL write, and its own sends read only pages the request still holds.
"""

from __future__ import annotations

from common.disaggregation import TransferFactory, aux_slots, make_kv_manager
from common.scheduler.role import RoleEngine, RoleSpec, SchedulerParts, TransferLink
from common.server.server_args import ServerArgs
from kv_transfer import AuxBuffer, KVManager
from prefill_server.scheduler import PrefillScheduler


def prefill_role(args: ServerArgs, transfer_factory: TransferFactory = KVManager) -> RoleSpec:
    def build(parts: SchedulerParts) -> RoleEngine:
        manager = make_kv_manager("prefill", args, parts.kv_pool, AuxBuffer(aux_slots(args)), transfer_factory,
                                  parts.kv_link)
        scheduler = PrefillScheduler(
            parts.cfg, parts.executor, parts.kv, future_capacity=parts.future_capacity, output=parts.output,
            transfer=manager,
        )
        return RoleEngine(scheduler, TransferLink(manager, scheduler.poll_transfers, manager.bootstrap_port))

    return RoleSpec("prefill", radix_cache=True, defer_frees=False, needs_bootstrap=True, build=build)
