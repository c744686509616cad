"""What the prefill and decode roles share: their KV transfer manager, built from ServerArgs.

    make_kv_manager(role, args, kv_pool, aux_buffer, factory)   the role's KVManager
    transfer_failure(req, handle)   the client-facing FinishReason of a failed transfer
    transfer_stats(manager)         the manager's counters as `kv_transfer_*` engine stats

The role specs themselves live with their schedulers (prefill_server/role.py,
decode_server/role.py); both take a `TransferFactory` so tests can hand in a fake manager.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Literal, Protocol

from common.cache.kv_pool import KVPool
from common.cluster_secret import ClusterSecret
from common.scheduler.messages import FinishReason
from common.scheduler.req import Req
from common.server.server_args import ServerArgs
from kv_transfer import AuxBuffer, FailureCause, KVManager, KVManagerArgs, TransferConfig

logger = logging.getLogger(__name__)

TransferFactory = Callable[[KVManagerArgs], KVManager]


class FailedHandle(Protocol):
    room: int

    @property
    def failure_reason(self) -> str | None: ...
    @property
    def failure_cause(self) -> FailureCause | None: ...


def transfer_config(args: ServerArgs) -> TransferConfig:
    return TransferConfig(
        bootstrap_timeout_s=args.disaggregation_bootstrap_timeout,
        transfer_timeout_s=args.disaggregation_transfer_timeout,
        engine_watch_timeout_s=args.watchdog_timeout if args.disaggregation_mode == "prefill" else None,
        heartbeat_interval_s=args.disaggregation_heartbeat_interval,
        heartbeat_timeout_s=args.disaggregation_heartbeat_timeout,
        handshake_timeout_s=args.disaggregation_handshake_timeout,
        drain_timeout_s=args.disaggregation_drain_timeout,
        faults=args.disaggregation_fault_spec or "",
    )


def aux_slots(args: ServerArgs) -> int:
    return 4 * (args.max_running_requests + 64)


def make_kv_manager(
    role: Literal["prefill", "decode"], args: ServerArgs, kv_pool: KVPool, aux_buffer: AuxBuffer,
    factory: TransferFactory = KVManager, kv_link: str = "",
) -> KVManager:
    """kv_link (TP > 1): where the transfer agents of ranks 1..N-1 say hello (each moves its own heads)."""
    return factory(
        KVManagerArgs(
            role=role,
            layout=kv_pool.layout,
            kv_buffer=kv_pool.kv,
            aux_buffer=aux_buffer,
            bootstrap_host=args.host,
            bootstrap_port=args.disaggregation_bootstrap_port if role == "prefill" else 0,
            config=transfer_config(args),
            backend=args.disaggregation_transfer_backend,
            cluster_secret=ClusterSecret.load(args.cluster_secret_file),
            kv_head_start=kv_pool.kv_head_start,
            tp_size=args.tp_size,
            tp_link=kv_link,
        )
    )


def transfer_failure(req: Req, handle: FailedHandle) -> FinishReason:
    """The client-facing error of a failed KV transfer (either role).

    Timeouts are 504; a transfer the other side gave up on (its client left, or it failed on
    its own) is 499: not this worker's fault, so a router neither blames nor retries it.
    """
    reason = handle.failure_reason or "KV transfer failed"
    cause = handle.failure_cause.value if handle.failure_cause else "kv_transfer_failed"
    logger.warning("rid=%s room=%s transfer failed: %s", req.rid, handle.room, reason)
    status = 504 if "timeout" in cause else 499 if cause == FailureCause.ABORTED.value else 500
    return FinishReason("abort", message=f"KV transfer failed: {reason}", status_code=status, err_type=cause)


def transfer_stats(manager: KVManager) -> dict[str, float]:
    """The manager's numeric counters as `kv_transfer_*` engine stats."""
    return {f"kv_transfer_{k}": float(v) for k, v in manager.stats().items() if isinstance(v, (int, float))}
