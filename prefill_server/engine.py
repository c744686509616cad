"""The prefill instance's engine process: the engine loop with the prefill role.

The role's KVManager binds --disaggregation-bootstrap-port (decode instances fetch the
layout and NIXL metadata there) and pushes KV pages to decode over NIXL.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.server.ipc import EngineIpcAddrs
    from common.server.server_args import ServerArgs


def prefill_engine_main(args: ServerArgs, addrs: EngineIpcAddrs) -> None:
    """Runs in the spawned engine process; imports the engine (torch) there only, so the HTTP
    frontend that names this function never loads torch."""
    from common.server.engine_process import engine_main
    from prefill_server.role import prefill_role

    engine_main(args, addrs, prefill_role(args))
