"""The extra processes of a tensor-parallel instance (--tp-size N > 1), as rank 0 sees them.

    engine process = rank 0 (scheduler, ZMQ to the frontend, its shard of the model)
      └─ TPRanks.start(): ranks 1..N-1, each tp_rank_process.tp_rank_main in a spawned process
    all N join one torch.distributed group (gloo on CPU, NCCL on CUDA; init through a file
    store in the instance's private directory), load their shard, meet at a barrier, then serve.
    PD roles: before the barrier each rank r > 0 starts its own KV transfer agent, which says
    hello on TPAddrs.kv_link to rank 0's KVManager (kv_transfer/rank_agent.py, rank_link.py).

Rank r runs on cuda:(base_gpu_id + r). A rank that dies takes the instance down: rank 0 sees
it (dead_reason, or a collective that raises) and exits, which fails the frontend's /health;
the other ranks exit when rank 0 is gone (their collectives raise, or their parent is gone).
TP 1 never comes here: no extra process, no torch.distributed.

The ranks meet only where other local users cannot: the file store and every ipc socket live in
one 0700 directory (security review 2, M5; removed when the instance stops), and gloo/NCCL listen
on --host's interface (L10; an operator's GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME win).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch

from common.model.tensor_parallel import TPGroup
from common.scheduler.tp_worker import StepFanout, TPStop
from common.server.server_args import ServerArgs
from kv_transfer.ucx_env import interface_of

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0
START_WATCH_S = 0.5


@dataclass(frozen=True)
class TPAddrs:
    """Where the ranks of one instance meet: the distributed init file and each rank's step inbox,
    all in `dir` (0700: no other user connects to a socket or reads the store)."""

    dir: str
    dist_init: str  # file:// init_method of torch.distributed
    steps: tuple[str, ...]  # ipc:// inbox of ranks 1..N-1
    kv_pools: tuple[str, ...]  # decode on CPU: each rank's KV pool file (rank 0 maps them: retraction); else ()
    kv_link: str  # PD: rank 0's KVManager, where the KV transfer agents of ranks 1..N-1 connect
    ifname: str | None = None  # --host's interface, for gloo/NCCL's listeners; None: a wildcard host

    @classmethod
    def new(cls, size: int, kv_files: bool = False, host: str = "127.0.0.1", parent: str | None = None) -> TPAddrs:
        """kv_files: the ranks' KV pools live in shared files (decode, whose retraction copies
        every rank's heads through rank 0); elsewhere each rank's pool is its own memory.
        parent: the instance's own 0700 directory (removed with it when the frontend stops, even
        if the engine was killed); None: a new directory in /tmp."""
        path = tempfile.mkdtemp(prefix=f"pdserve_tp_{os.getpid()}_", dir=parent)
        tag = f"pdserve_tp_{os.getpid()}_{os.path.basename(path).rsplit('_', 1)[-1]}"
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        return cls(dir=path, dist_init=f"file://{path}/dist", steps=tuple(f"ipc://{path}/rank{r}" for r in range(1, size)),
                   kv_pools=tuple(os.path.join(shm, f"{tag}_kv{r}") for r in range(size)) if kv_files else (),
                   kv_link=f"ipc://{path}/kvlink", ifname=interface_of(host))

    def remove_files(self) -> None:
        """Unlinked files stay valid where they are open or mapped (store, KV pools); the sockets
        stay until remove_dir (a rank's transfer agent may still be connecting)."""
        _unlink([self.dist_init.removeprefix("file://"), *self.kv_pools])

    def remove_dir(self) -> None:
        self.remove_files()
        shutil.rmtree(self.dir, ignore_errors=True)


def _unlink(paths: list[str] | tuple[str, ...]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def set_rank_threads(device: torch.device, size: int) -> None:
    """CPU: the ranks share the cores; each gets its part (at least one thread)."""
    if device.type == "cpu":
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // size))


@contextlib.contextmanager
def _listen_on(ifname: str | None) -> Iterator[None]:
    """gloo and NCCL listen on `ifname` (--host's interface) unless the operator set their
    variables. GLOO_SOCKET_IFNAME is read when a gloo group is made, so it is set only meanwhile:
    neither a later in-process group on another --host nor a child process inherits it. NCCL
    reads its variable when its first communicator is made (lazily, at the first collective), so
    NCCL_SOCKET_IFNAME stays set."""
    if ifname is None or "GLOO_SOCKET_IFNAME" in os.environ:
        if ifname is not None:
            os.environ.setdefault("NCCL_SOCKET_IFNAME", ifname)
        yield
        return
    os.environ.setdefault("NCCL_SOCKET_IFNAME", ifname)
    os.environ["GLOO_SOCKET_IFNAME"] = ifname
    try:
        yield
    finally:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)


def init_tp_group(rank: int, size: int, addrs: TPAddrs, device: torch.device, timeout_s: float) -> TPGroup:
    """Join the instance's group. NCCL carries activations on CUDA; gloo carries them on CPU
    (and, on CUDA, the start barrier)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    with _listen_on(addrs.ifname):  # gloo/NCCL listen where --host is, not on the hostname's interface
        torch.distributed.init_process_group(
            backend, init_method=addrs.dist_init, rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s)
        )
        cpu_group = torch.distributed.new_group(backend="gloo") if backend == "nccl" else None
    return TPGroup(rank, size, device_group=None, cpu_group=cpu_group)


class TPRanks:
    """Rank 0's handle on ranks 1..N-1: start them, know when one died, stop them."""

    def __init__(self, args: ServerArgs, run_dir: str | None = None) -> None:
        self.size = args.tp_size
        self.addrs = TPAddrs.new(self.size, kv_files=args.disaggregation_mode == "decode", host=args.host,
                                 parent=run_dir)
        self.fanout = StepFanout(list(self.addrs.steps), self.dead_reason)
        self._started = threading.Event()
        ctx = multiprocessing.get_context("spawn")
        from common.server.tp_rank_process import tp_rank_main

        self._procs = [
            # daemon: ended with this process even when it exits on an error
            ctx.Process(target=tp_rank_main, args=(args, rank, self.addrs, os.getpid()), name=f"pdserve-tp{rank}",
                        daemon=True)
            for rank in range(1, self.size)
        ]

    def start(self) -> None:
        """Start ranks 1..N-1, and watch them until `started()`: rank 0 waits for them inside
        torch.distributed's rendezvous and barrier, which a rank that died before joining
        would hold for the whole timeout; this process exits at once instead (its frontend
        then reports the failed start)."""
        for proc in self._procs:
            proc.start()
        logger.info("TP ranks 1..%d started (pids %s)", self.size - 1, [p.pid for p in self._procs])
        threading.Thread(target=self._watch_start, name="tp-start-watch", daemon=True).start()

    def started(self) -> None:
        self._started.set()

    def _watch_start(self) -> None:
        while not self._started.wait(START_WATCH_S):
            dead = self.dead_reason()
            if dead is not None:
                logger.error("%s while the instance was starting; the engine exits", dead)
                self.addrs.remove_dir()
                os._exit(1)

    def dead_reason(self) -> str | None:
        """None while every rank runs, else which one ended and how."""
        for rank, proc in enumerate(self._procs, start=1):
            if proc.pid is not None and not proc.is_alive():
                code = proc.exitcode
                how = f"killed by signal {signal.Signals(-code).name}" if code is not None and code < 0 else (
                    f"exited with code {code}")
                return f"TP rank {rank} (pid {proc.pid}) {how}"
        return None

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """TPStop and a bounded join while all ranks live; SIGKILL at once when one died (the
        rest may sit in a collective that never completes)."""
        self._started.set()  # stopping on purpose: the start watch must not end this process
        graceful = self.dead_reason() is None
        if graceful:
            try:
                self.fanout.send(TPStop(), timeout_s=1.0)
            except RuntimeError:
                graceful = False
        for proc in self._procs:
            if proc.pid is None:
                continue
            if graceful:
                proc.join(timeout_s)
            if proc.is_alive():
                proc.kill()
            proc.join(timeout_s)
        self.fanout.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        self.addrs.remove_dir()
