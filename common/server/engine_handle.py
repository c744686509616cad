"""The engine child process of one instance, as seen by its launcher.

EngineHandle spawns `engine_main(server_args, ipc_addrs)` in a fresh process
(multiprocessing "spawn": no inherited CUDA or event-loop state), reports when
it has died and why, and stops it (SIGTERM, then SIGKILL after a bound).

Inside the child, `_engine_entry` sets up logging, ignores SIGINT (Ctrl-C in a
terminal reaches the whole process group; the frontend decides when the engine
stops), and exits on its own when its parent frontend disappears, so an engine
never outlives its frontend even after a kill -9. It also arms the test-only step
fault (--engine-fault-spec) and faulthandler on SIGUSR1, so `dump_stacks()` puts
every engine thread's stack in the log (the watchdog does it before it stops a
hung engine).
"""

from __future__ import annotations

import faulthandler
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from common.cpu_runtime import NO_PLACEMENT, EnginePlacement
from common.logs import configure_logging
from common.scheduler import step_fault
from common.server.ipc import EngineIpcAddrs
from common.server.liveness import step_clock_path
from common.server.server_args import ServerArgs

logger = logging.getLogger(__name__)

EngineMain = Callable[[ServerArgs, EngineIpcAddrs], None]
PARENT_POLL_S = 0.5


def _exit_when_orphaned(parent_pid: int, addrs: EngineIpcAddrs) -> None:
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent_pid:
            logger.error("frontend process %d is gone; engine exits", parent_pid)
            addrs.remove_files()  # the frontend could not
            _unlink(step_clock_path(addrs))
            os._exit(1)


def _engine_entry(engine_main: EngineMain, args: ServerArgs, addrs: EngineIpcAddrs, parent_pid: int) -> None:
    configure_logging(args.log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    step_fault.install(args.engine_fault_spec)
    threading.Thread(
        target=_exit_when_orphaned, args=(parent_pid, addrs), name="orphan-watch", daemon=True
    ).start()
    try:
        engine_main(args, addrs)
    except Exception:
        logger.exception("engine failed")
        sys.exit(1)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class EngineHandle:
    """Owned by the launcher; the frontend only asks `dead_reason()`."""

    def __init__(self, args: ServerArgs, addrs: EngineIpcAddrs, engine_main: EngineMain,
                 placement: EnginePlacement = NO_PLACEMENT) -> None:
        """placement: the engine's CPUs and environment (common/cpu_runtime.py), in force from
        its first instruction: see start()."""
        self._placement = placement
        ctx = multiprocessing.get_context("spawn")
        self._proc = ctx.Process(
            target=_engine_entry,
            args=(engine_main, args, addrs, os.getpid()),
            name="pdserve-engine",
        )

    def start(self) -> None:
        """Spawn (fork + exec) the engine with the placement's variables in the environment and its
        CPUs as this thread's affinity, which the child inherits; both are restored here after."""
        placement = self._placement
        saved_env = {k: os.environ.get(k) for k in placement.env}
        saved_cpus = os.sched_getaffinity(0) if placement.cpus is not None else None
        try:
            os.environ.update(placement.env)
            if placement.cpus is not None:
                os.sched_setaffinity(0, placement.cpus)  # this thread only; fork copies it
            self._proc.start()
        finally:
            if saved_cpus is not None:
                os.sched_setaffinity(0, saved_cpus)
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        logger.info("engine process started (pid %s)", self._proc.pid)

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def dump_stacks(self) -> None:
        """Ask the engine to write every thread's stack to the log (faulthandler, SIGUSR1)."""
        if self._proc.pid is not None and self._proc.is_alive():
            os.kill(self._proc.pid, signal.SIGUSR1)

    def dead_reason(self) -> str | None:
        """None while the engine runs, else how it ended."""
        if self._proc.pid is None or self._proc.is_alive():
            return None
        code = self._proc.exitcode
        if code is not None and code < 0:
            try:
                return f"killed by signal {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exited with code {code}"

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._proc.pid is None or not self._proc.is_alive():
            return
        self._proc.terminate()
        self._proc.join(timeout_s)
        if self._proc.is_alive():
            logger.warning("engine did not stop within %ss of SIGTERM; killing it", timeout_s)
            self._proc.kill()
            self._proc.join(timeout_s)
