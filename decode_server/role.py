"""The decode role: DecodeScheduler + a KVManager that receives into reserved pages.

Decode keeps no prefix cache unless --disaggregation-decode-enable-radix-cache (then a
finished request's KV stays in decode's tree and a later prompt sharing it is sent only
its missing pages), and frees a finished request's pages only after the step in flight
completed: that step may still write the request's next KV there, and a NIXL write for a
request admitted meanwhile is not ordered behind it (common/scheduler/kv_manager.py).
"""

from __future__ import annotations

import logging

from common.disaggregation import TransferFactory, aux_slots, make_kv_manager
from common.scheduler.role import RoleEngine, RoleSpec, SchedulerParts, TransferLink
from common.server.server_args import ServerArgs
from decode_server.scheduler import DecodeScheduler
from kv_transfer import AuxBuffer, AuxSlotAllocator, KVManager

logger = logging.getLogger(__name__)


def decode_role(args: ServerArgs, transfer_factory: TransferFactory = KVManager) -> RoleSpec:
    def build(parts: SchedulerParts) -> RoleEngine:
        num_slots = aux_slots(args)
        manager = make_kv_manager("decode", args, parts.kv_pool, AuxBuffer(num_slots), transfer_factory, parts.kv_link)
        swap_space = int(args.swap_space * 2**30)
        if args.tp_size > 1 and len(parts.kv_pool.rank_views) != args.tp_size - 1:
            # the host copy of a retracted request reads every rank's heads through rank 0's mapping
            # of their pools (CPU); without it a retraction ends its request with a 503
            logger.warning("TP decode on %s: retracted requests end with an error (no host copy of other "
                           "ranks' KV)", parts.kv_pool.device)
            swap_space = 0
        scheduler = DecodeScheduler(
            parts.cfg, parts.executor, parts.kv, future_capacity=parts.future_capacity, output=parts.output,
            transfer=manager, aux_slots=AuxSlotAllocator(num_slots), kv_pool=parts.kv_pool,
            num_reserved_decode_tokens=args.num_reserved_decode_tokens,
            local_prefill_max_tokens=args.disaggregation_local_prefill_max_tokens,
            swap_space_bytes=swap_space,
        )
        return RoleEngine(scheduler, TransferLink(manager, scheduler.poll_transfers))

    cache = args.disaggregation_decode_enable_radix_cache
    return RoleSpec("decode", radix_cache=cache, defer_frees=True, needs_bootstrap=True, build=build,
                    local_prefill=cache)
