"""The decode instance's engine process: the engine loop with the decode role."""

from __future__ import annotations

from common.server.engine_process import engine_main
from common.server.ipc import EngineIpcAddrs
from common.server.server_args import ServerArgs
from decode_server.role import decode_role


def decode_engine_main(args: ServerArgs, addrs: EngineIpcAddrs) -> None:
    engine_main(args, addrs, decode_role(args))
