"""The decode instance's engine process: the engine loop with the decode role."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.server.ipc import EngineIpcAddrs
    from common.server.server_args import ServerArgs


def decode_engine_main(args: ServerArgs, addrs: EngineIpcAddrs) -> None:
    """Runs in the spawned engine process; imports the engine (torch) there only, so the HTTP
    frontend that names this function never loads torch."""
    from common.server.engine_process import engine_main
    from decode_server.role import decode_role

    engine_main(args, addrs, decode_role(args))
