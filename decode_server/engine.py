"""The decode instance's engine process: the engine loop plus a KV transfer manager.

Decode keeps no prefix cache (prompts arrive whole from prefill), frees pages only
after the step in flight completed (a NIXL write is not ordered behind it), and
reads first tokens from the aux rows prefill writes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from common.scheduler.req import Req
from common.scheduler.scheduler import RequestRejected
from common.server.engine_process import EngineLoop, engine_main
from common.server.io_struct import GenerateReq
from common.server.ipc import EngineIpcAddrs
from common.server.server_args import ServerArgs
from decode_server.scheduler import DecodeScheduler
from kv_transfer import AuxBuffer, AuxSlotAllocator, KVManager, KVManagerArgs
from prefill_server.engine import aux_slots, transfer_config


class DecodeEngineLoop(EngineLoop):
    scheduler_cls = DecodeScheduler

    def adjust_args(self, args: ServerArgs) -> ServerArgs:
        return dataclasses.replace(args, disable_radix_cache=True)

    def core_options(self) -> dict[str, Any]:
        return {"defer_frees": True}

    def make_scheduler_kwargs(self) -> dict[str, Any]:
        return {"num_reserved_decode_tokens": self.args.num_reserved_decode_tokens}

    def setup(self) -> None:
        pool = self.core.kv_pool
        n = aux_slots(self.args)
        aux = AuxBuffer(n)
        self.transfer = KVManager(
            KVManagerArgs(
                role="decode",
                layout=pool.layout,
                k_buffers=pool.k_buffers,
                v_buffers=pool.v_buffers,
                aux_buffer=aux,
                bootstrap_host=self.args.host,
                config=transfer_config(self.args),
            )
        )
        self.scheduler.attach_transfer(self.transfer, AuxSlotAllocator(n), pool)

    def make_req(self, msg: GenerateReq) -> Req:
        if msg.bootstrap is None:
            raise RequestRejected("a decode instance needs bootstrap_host, bootstrap_port and bootstrap_room")
        req = super().make_req(msg)
        req.extra["bootstrap"] = (msg.bootstrap.host, msg.bootstrap.port, msg.bootstrap.room)
        return req

    def before_step(self) -> None:
        self.scheduler.poll_transfers()

    def shutdown(self) -> None:
        super().shutdown()
        self.transfer.shutdown()


def decode_engine_main(args: ServerArgs, addrs: EngineIpcAddrs) -> None:
    engine_main(args, addrs, loop_cls=DecodeEngineLoop)


