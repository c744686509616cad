"""The body of TP rank r > 0 (started by TPRanks in rank 0's engine process).

    join the group -> build this rank's RankWorker (its shard, its KV pool slice) -> barrier
    -> PD roles: this rank's KV transfer agent (kv_transfer/rank_agent.py: its own NIXL agent over
       its own KV slice, driven by rank 0's KVManager)
    -> TPFollower.serve(): run rank 0's steps until TPStop or until rank 0 is gone

An exception (a collective that fails because another rank died) ends the process with
code 1, which rank 0 sees; rank 0 gone ends it too, so no rank outlives its instance.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from common.cache.kv_pool import KVPool
from common.logs import configure_logging
from common.server.server_args import ServerArgs
from common.server.tp_ranks import TPAddrs, init_tp_group, set_rank_threads

logger = logging.getLogger(__name__)


def tp_rank_main(args: ServerArgs, rank: int, addrs: TPAddrs, parent_pid: int) -> None:
    configure_logging(args.log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the frontend owns Ctrl-C
    try:
        _serve(args, rank, addrs, parent_pid)
    except Exception:
        logger.exception("TP rank %d failed", rank)
        sys.exit(1)


def _serve(args: ServerArgs, rank: int, addrs: TPAddrs, parent_pid: int) -> None:
    from common.engine_core import build_rank_worker
    from common.model.device import resolve_device
    from common.scheduler.tp_worker import TPFollower

    device = resolve_device(args.device, args.base_gpu_id + rank)
    set_rank_threads(device, args.tp_size)
    tp = init_tp_group(rank, args.tp_size, addrs, device, args.engine_start_timeout)
    rw = build_rank_worker(args, tp, kv_shared_path=addrs.kv_pools[rank] if addrs.kv_pools else None)
    follower = TPFollower(rw.worker, addrs.steps[rank - 1])
    if args.disaggregation_mode in ("prefill", "decode"):  # its hello reaches rank 0's KVManager (rank_link.py)
        _start_transfer_agent(args, rank, addrs, rw.runner.kv_pool)
    tp.barrier()
    logger.info("TP rank %d of %d ready on %s (%d KV heads)", rank, tp.size, device, rw.runner.kv_pool.num_kv_heads)
    follower.serve(lambda: os.getppid() == parent_pid)
    if os.getppid() != parent_pid:  # rank 0 was killed: nobody else removes the meeting directory
        addrs.remove_dir()


def _start_transfer_agent(args: ServerArgs, rank: int, addrs: TPAddrs, pool: KVPool) -> None:
    from common.disaggregation import transfer_config
    from kv_transfer.rank_agent import RankAgent, RankAgentArgs

    RankAgent(RankAgentArgs(
        role=args.disaggregation_mode, rank=rank, link_addr=addrs.kv_link, kv_buffer=pool.kv,
        kv_head_start=pool.kv_head_start, bootstrap_host=args.host,
        backend=args.disaggregation_transfer_backend, config=transfer_config(args),
    ), on_crash=lambda: os._exit(1))  # its daemon thread serves until this process ends; a crash ends the rank
