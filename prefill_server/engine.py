"""The prefill instance's engine process: the engine loop plus a KV transfer manager.

The KVManager binds --disaggregation-bootstrap-port (decode instances fetch the
layout and NIXL metadata there) and pushes KV pages to decode over NIXL.
"""

from __future__ import annotations

import logging

from common.scheduler.req import Req
from common.scheduler.scheduler import RequestRejected
from common.server.engine_process import EngineLoop, engine_main
from common.server.io_struct import GenerateReq
from common.server.ipc import EngineIpcAddrs
from common.server.server_args import ServerArgs
from kv_transfer import AuxBuffer, KVManager, KVManagerArgs, TransferConfig
from prefill_server.scheduler import PrefillScheduler

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


class PrefillEngineLoop(EngineLoop):
    scheduler_cls = PrefillScheduler

    def setup(self) -> None:
        pool = self.core.kv_pool
        self.transfer = KVManager(
            KVManagerArgs(
                role="prefill",
                layout=pool.layout,
                k_buffers=pool.k_buffers,
                v_buffers=pool.v_buffers,
                aux_buffer=AuxBuffer(aux_slots(self.args)),
                bootstrap_host=self.args.host,
                bootstrap_port=self.args.disaggregation_bootstrap_port,
                config=transfer_config(self.args),
            )
        )
        self.scheduler.attach_transfer(self.transfer)
        logger.info("KV transfer bootstrap on %s:%d", self.args.host, self.transfer.bootstrap_port)

    def make_req(self, msg: GenerateReq) -> Req:
        if msg.bootstrap is None:
            raise RequestRejected("a prefill instance needs bootstrap_host, bootstrap_port and bootstrap_room")
        req = super().make_req(msg)
        req.extra["bootstrap_room"] = msg.bootstrap.room
        return req

    def before_step(self) -> None:
        self.scheduler.poll_transfers()

    def stats(self) -> dict[str, float]:
        s = super().stats()
        s["bootstrap_port"] = float(self.transfer.bootstrap_port)
        return s

    def shutdown(self) -> None:
        super().shutdown()
        self.transfer.shutdown()


def prefill_engine_main(args: ServerArgs, addrs: EngineIpcAddrs) -> None:
    engine_main(args, addrs, loop_cls=PrefillEngineLoop)
