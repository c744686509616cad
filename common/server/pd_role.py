"""What the prefill and decode engine loops share: a KV transfer manager beside the engine.

    PDEngineLoop (EngineLoop)
      setup()          builds the role's KVManager over the engine's KV pool
      make_req()       requires the bootstrap fields; refuses (503) while the transfer
                       manager is unhealthy, so a router sends the request elsewhere
      before_step()    the role scheduler polls its transfers
      health_problem() the transfer manager's problem (dead or stuck thread): /health 503
      shutdown()       engine first, then the transfer manager (bounded)

PrefillEngineLoop and DecodeEngineLoop add their scheduler class and role details.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from common.scheduler.req import Req
from common.scheduler.scheduler import RequestRejected
from common.server.engine_process import EngineLoop
from common.server.io_struct import FinishReason, GenerateReq
from common.server.server_args import ServerArgs
from kv_transfer import (
    AuxBuffer,
    FailureCause,
    KVManager,
    KVManagerArgs,
    KVReceiver,
    KVSender,
    TransferConfig,
)

logger = logging.getLogger(__name__)


def transfer_config(args: ServerArgs) -> TransferConfig:
    return TransferConfig(
        bootstrap_timeout_s=args.disaggregation_bootstrap_timeout,
        transfer_timeout_s=args.disaggregation_transfer_timeout,
        heartbeat_interval_s=args.disaggregation_heartbeat_interval,
        heartbeat_timeout_s=args.disaggregation_heartbeat_timeout,
        handshake_timeout_s=args.disaggregation_handshake_timeout,
        drain_timeout_s=args.disaggregation_drain_timeout,
        faults=args.disaggregation_fault_spec or "",
    )


def aux_slots(args: ServerArgs) -> int:
    return 4 * (args.max_running_requests + 64)


def transfer_failure(req: Req, handle: KVSender | KVReceiver) -> FinishReason:
    """The client-facing error of a failed KV transfer (either role).

    Timeouts are 504; a transfer the other side gave up on (its client left, or it failed on
    its own) is 499: not this worker's fault, so a router neither blames nor retries it.
    """
    reason = handle.failure_reason or "KV transfer failed"
    cause = handle.failure_cause.value if handle.failure_cause else "kv_transfer_failed"
    logger.warning("rid=%s room=%s transfer failed: %s", req.rid, handle.room, reason)
    status = 504 if "timeout" in cause else 499 if cause == FailureCause.ABORTED.value else 500
    return FinishReason("abort", message=f"KV transfer failed: {reason}", status_code=status, err_type=cause)


def transfer_stats(manager: KVManager | None) -> dict[str, float]:
    """The manager's numeric counters as `kv_transfer_*` engine stats."""
    if manager is None:
        return {}
    return {f"kv_transfer_{k}": float(v) for k, v in manager.stats().items() if isinstance(v, (int, float))}


class PDEngineLoop(EngineLoop):
    role: Literal["prefill", "decode"]
    transfer: KVManager

    def transfer_args(self) -> dict[str, Any]:
        """Role-specific KVManagerArgs fields (bootstrap port on prefill)."""
        return {}

    def setup(self) -> None:
        pool = self.core.kv_pool
        self.aux_buffer = AuxBuffer(aux_slots(self.args))
        self.transfer = KVManager(
            KVManagerArgs(
                role=self.role,
                layout=pool.layout,
                k_buffers=pool.k_buffers,
                v_buffers=pool.v_buffers,
                aux_buffer=self.aux_buffer,
                bootstrap_host=self.args.host,
                config=transfer_config(self.args),
                **self.transfer_args(),
            )
        )

    def make_req(self, msg: GenerateReq) -> Req:
        if msg.bootstrap is None:
            raise RequestRejected(f"a {self.role} instance needs bootstrap_host, bootstrap_port and bootstrap_room")
        problem = self.transfer.health()
        if problem is not None:
            raise RequestRejected(f"{self.role} instance cannot transfer KV: {problem}", status_code=503)
        return super().make_req(msg)

    def before_step(self) -> None:
        self.scheduler.poll_transfers()  # type: ignore[attr-defined]

    def health_problem(self) -> str | None:
        return self.transfer.health()

    def shutdown(self) -> None:
        super().shutdown()
        self.transfer.shutdown()


__all__ = ["PDEngineLoop", "aux_slots", "transfer_config", "transfer_failure", "transfer_stats"]
