"""The prefill instance's engine process: the engine loop plus a KV transfer manager.

The KVManager binds --disaggregation-bootstrap-port (decode instances fetch the
layout and NIXL metadata there) and pushes KV pages to decode over NIXL.
"""

from __future__ import annotations

import logging
from typing import Any

from common.scheduler.req import Req
from common.server.engine_process import engine_main
from common.server.io_struct import GenerateReq
from common.server.ipc import EngineIpcAddrs
from common.server.pd_role import PDEngineLoop
from common.server.server_args import ServerArgs
from prefill_server.scheduler import PrefillScheduler

logger = logging.getLogger(__name__)


class PrefillEngineLoop(PDEngineLoop):
    scheduler_cls = PrefillScheduler
    role = "prefill"

    def transfer_args(self) -> dict[str, Any]:
        return {"bootstrap_port": self.args.disaggregation_bootstrap_port}

    def setup(self) -> None:
        super().setup()
        self.scheduler.attach_transfer(self.transfer)
        logger.info("KV transfer bootstrap on %s:%d", self.args.host, self.transfer.bootstrap_port)

    def make_req(self, msg: GenerateReq) -> Req:
        req = super().make_req(msg)
        assert msg.bootstrap is not None
        req.extra["bootstrap_room"] = msg.bootstrap.room
        return req

    def stats(self) -> dict[str, float]:
        s = super().stats()
        s["bootstrap_port"] = float(self.transfer.bootstrap_port)
        return s


def prefill_engine_main(args: ServerArgs, addrs: EngineIpcAddrs) -> None:
    engine_main(args, addrs, loop_cls=PrefillEngineLoop)
