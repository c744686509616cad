"""The decode instance's engine process: the engine loop plus a KV transfer manager.

Decode keeps no prefix cache (prompts arrive whole from prefill), frees pages only
after the step in flight completed (a NIXL write is not ordered behind it), and
reads first tokens from the aux rows prefill writes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from common.scheduler.req import Req
from common.server.engine_process import engine_main
from common.server.io_struct import GenerateReq
from common.server.ipc import EngineIpcAddrs
from common.server.pd_role import PDEngineLoop
from common.server.server_args import ServerArgs
from decode_server.scheduler import DecodeScheduler
from kv_transfer import AuxSlotAllocator


class DecodeEngineLoop(PDEngineLoop):
    scheduler_cls = DecodeScheduler
    role = "decode"

    def adjust_args(self, args: ServerArgs) -> ServerArgs:
        return dataclasses.replace(args, disable_radix_cache=True)

    def core_options(self) -> dict[str, Any]:
        return {"defer_frees": True}

    def make_scheduler_kwargs(self) -> dict[str, Any]:
        return {"num_reserved_decode_tokens": self.args.num_reserved_decode_tokens}

    def setup(self) -> None:
        super().setup()
        allocator = AuxSlotAllocator(self.aux_buffer.num_slots)
        self.scheduler.attach_transfer(self.transfer, allocator, self.core.kv_pool)

    def make_req(self, msg: GenerateReq) -> Req:
        req = super().make_req(msg)
        assert msg.bootstrap is not None
        req.extra["bootstrap"] = (msg.bootstrap.host, msg.bootstrap.port, msg.bootstrap.room)
        return req


def decode_engine_main(args: ServerArgs, addrs: EngineIpcAddrs) -> None:
    engine_main(args, addrs, loop_cls=DecodeEngineLoop)


