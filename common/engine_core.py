"""Assembles one engine: model runner + KV memory + scheduler, from ServerArgs.

Used by the offline Engine, the colocated engine process and the PD roles, each of
which hands its RoleSpec (common/scheduler/role.py). Nothing here runs a loop.

    ServerArgs, RoleSpec -> ModelConfig, KVPool, ReqToTokenPool, PageAllocator, RadixCache
                         -> ReqKVManager(defer_frees=role.defer_frees) -> TorchModelWorker
                         -> Sync/Launch/ThreadExecutor -> role.build(SchedulerParts) -> scheduler (+ transfer)

With --tp-size N > 1 this process is rank 0: it starts ranks 1..N-1 (tp_ranks.py), which build
the same RankWorker (build_rank_worker) on their shard, and wraps its worker in a
TPLeaderWorker that hands each step to them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from common.cache import PageAllocator, RadixCache, ReqToTokenPool
from common.cache.kv_pool import KVPool
from common.cluster_secret import ClusterSecret
from common.grammar.backend import GrammarBackend
from common.model.config import ModelConfig, resolve_dtype
from common.model.default_model import resolve_model_path
from common.model.device import on_device_thread, resolve_device, use_device
from common.model.device_streams import make_device_streams
from common.model.intra_op import run_on_fresh_thread
from common.model.memory_budget import kv_budget_bytes
from common.model.model_runner import ModelRunner
from common.model.sampler import Sampler
from common.model.tensor_parallel import NO_TP, TPGroup, TPShard
from common.scheduler import step_fault
from common.scheduler.config import SchedulerConfig
from common.scheduler.executor import (
    Executor,
    LaunchedStep,
    LaunchExecutor,
    SplitWorker,
    SyncExecutor,
    ThreadExecutor,
)
from common.scheduler.kv_manager import ReqKVManager
from common.scheduler.model_worker import TorchModelWorker
from common.scheduler.role import COLOCATED, RoleSpec, SchedulerParts, TransferLink
from common.scheduler.scheduler import OutputSink, Scheduler
from common.scheduler.tp_worker import TPLeaderWorker
from common.server.heap_trim import HeapTrimmer
from common.server.kv_event_publisher import KVEventPublisher
from common.server.server_args import ServerArgs
from common.server.tp_ranks import TPRanks, init_tp_group, set_rank_threads
from common.tokenizer_loading import load_tokenizer

logger = logging.getLogger(__name__)

def _no_phase(name: str) -> AbstractContextManager[object]:
    return nullcontext()


EXTRA_REQ_ROWS = 8  # rows beyond max_running_requests (chunked request, requests being admitted)


@dataclass
class EngineCore:
    args: ServerArgs
    model_path: str
    model_config: ModelConfig
    kv_pool: KVPool
    role: RoleSpec
    scheduler: Scheduler  # the role's (a PD role's subclass)
    transfer: TransferLink | None  # PD roles: their KV transfer manager
    executor: Executor
    runner: ModelRunner
    kv_events: KVEventPublisher | None = None  # instances with a prefix cache: its contents, for the router
    tp_ranks: TPRanks | None = None  # --tp-size > 1: ranks 1..N-1 (this process is rank 0)
    heap_trimmer: HeapTrimmer = dataclasses.field(default_factory=lambda: HeapTrimmer(0.0))

    def run_iteration(self, phase: Callable[[str], AbstractContextManager[object]] = _no_phase) -> None:
        """One engine-loop iteration after the inputs were taken in: poll the role's transfers,
        step when there is work, send outputs produced outside a step, and run the idle checks
        when nothing is left. Each part runs inside `phase(name)` (the liveness clock's
        phases: the watchdog sees a hang in any of them, common/server/liveness.py)."""
        if self.transfer is not None:
            with phase("transfer poll"):
                if self.scheduler.has_work:
                    step_fault.at_point("transfer_poll")
                self.transfer.poll()
        if self.scheduler.has_runnable_work:
            with phase("step"):
                self.scheduler.step()
        with phase("output flush"):
            self.scheduler.flush()
            if self.kv_events is not None:
                self.kv_events.flush()
        if not self.scheduler.has_work:
            with phase("idle checks"):
                self.scheduler.on_idle()  # reset new_token_ratio, check the pools once per idle spell
                self.heap_trimmer.idle()
        else:
            self.heap_trimmer.busy()

    def shutdown(self) -> None:
        """The engine first (no step may still read or write KV), then the transfer manager."""
        self.executor.shutdown()
        if self.scheduler.grammar_queue is not None:
            self.scheduler.grammar_queue.backend.shutdown()
        if self.transfer is not None:
            self.transfer.service.shutdown()
        if self.kv_events is not None:
            self.kv_events.close()
        if self.tp_ranks is not None:
            self.tp_ranks.stop()

    def ready_stats(self) -> dict[str, float]:
        s = self.scheduler.stats()
        s.update(
            {
                "max_total_tokens": float((self.kv_pool.num_pages - 1) * self.kv_pool.page_size),
                "kv_pool_bytes": float(self.kv_pool.total_bytes()),
                "context_length": float(self.model_config.context_length),
                "page_size": float(self.kv_pool.page_size),
                "vocab_size": float(self.model_config.vocab_size),
                "radix_cache_enabled": float(not self.scheduler.kv.radix.disable),
                "defer_frees": float(self.scheduler.kv.defer_frees),
                "tp_size": float(self.tp_ranks.size if self.tp_ranks is not None else 1),
            }
        )
        if self.transfer is not None and self.transfer.bootstrap_port is not None:
            s["bootstrap_port"] = float(self.transfer.bootstrap_port)
        if self.kv_events is not None:
            s["kv_events_port"] = float(self.kv_events.port)
        return s


def worker_thread(args: ServerArgs, device: torch.device) -> bool:
    """Does the overlap loop run the forward on a second thread? On CPU, yes: launching a step
    computes it. On CUDA, no: one thread launches step N+1 before it waits on step N."""
    if args.overlap_worker_thread == "auto":
        return device.type == "cpu"
    return args.overlap_worker_thread == "on"


def make_executor(
    args: ServerArgs, worker: SplitWorker[LaunchedStep], device: torch.device, on_thread_start: Callable[[], None]
) -> Executor:
    """SyncExecutor (normal loop), or the overlap loop on one thread or two (worker_thread)."""
    if not args.overlap_schedule:
        return SyncExecutor(worker)
    start = on_device_thread(device, on_thread_start)
    if worker_thread(args, device):
        return ThreadExecutor(worker, on_thread_start=start)
    return LaunchExecutor(worker, on_thread_start=start)


def scheduler_config(args: ServerArgs, context_length: int) -> SchedulerConfig:
    return SchedulerConfig(
        page_size=args.page_size,
        chunked_prefill_size=args.chunked_prefill_size,
        max_prefill_tokens=args.max_prefill_tokens,
        max_running_requests=args.max_running_requests,
        schedule_policy=args.effective_schedule_policy,
        schedule_conservativeness=args.schedule_conservativeness,
        enable_overlap=args.overlap_schedule,
        enable_mixed_chunk=args.enable_mixed_chunk,
        disable_radix_cache=args.disable_radix_cache,
        context_length=context_length,
        random_seed=args.random_seed or 0,
    )


def kv_budget_tokens(
    args: ServerArgs, config: ModelConfig, dtype: torch.dtype, device: torch.device, shard: TPShard | None = None
) -> int:
    """Token slots of the KV pool; under TP every rank arrives at the same count (same shard sizes)."""
    if args.max_total_tokens is not None:
        return args.max_total_tokens
    per_token = ModelRunner.kv_bytes_per_token(config, dtype, str(device), shard)
    budget = kv_budget_bytes(device, mem_fraction_static=args.mem_fraction_static, kv_cache_gb=args.kv_cache_gb)
    return max(args.page_size, budget // per_token)


@dataclass
class RankWorker:
    """What every TP rank builds alike: the model shard, its KV pool slice, the worker."""

    model_path: str
    config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    context_length: int
    req_pool: ReqToTokenPool
    runner: ModelRunner
    worker: TorchModelWorker
    future_capacity: int


def build_rank_worker(
    args: ServerArgs, tp: TPGroup = NO_TP, extra_req_rows: int = EXTRA_REQ_ROWS, kv_shared_path: str | None = None
) -> RankWorker:
    """Model runner + KV pool + req_to_token table + sampler of one rank (every rank at TP 1).
    kv_shared_path (CPU, TP > 1 decode): the KV pool lives in this shared file, for rank 0 to map."""
    model_path = resolve_model_path(args.model_path)
    config = ModelConfig.from_pretrained(model_path)
    device = resolve_device(args.device, args.base_gpu_id + tp.rank)
    use_device(device)
    dtype = resolve_dtype(args.dtype, device)
    shard = TPShard.of(config, tp.rank, tp.size)
    context_length = min(args.context_length or config.context_length, config.context_length)
    streams = make_device_streams(device)
    req_pool = ReqToTokenPool(
        args.max_running_requests + extra_req_rows, context_length + args.page_size, device=device, streams=streams
    )

    def create_kv_pool() -> KVPool:  # called by the runner once the weights are on the device
        total_tokens = kv_budget_tokens(args, config, dtype, device, shard)
        return ModelRunner.create_kv_pool(
            config, max_total_tokens=total_tokens, page_size=args.page_size, dtype=dtype, device=device,
            streams=streams, shard=shard, shared_path=kv_shared_path if device.type == "cpu" else None,
        )

    compile_decode = args.enable_torch_compile and device.type == "cpu" and tp.size == 1
    runner = ModelRunner(
        model_path, dtype=dtype, device=device, kv_pool=create_kv_pool, req_to_token=req_pool.table,
        attention_backend=args.attention_backend, streams=streams, tp=tp, keep_plain_weights=compile_decode,
        quantization=args.quantization, prefill_row_bucket=args.cpu_prefill_row_bucket,
    )
    if compile_decode:
        from common.model.compiled_decode import CompileCapture

        runner.enable_decode_graphs(min(args.torch_compile_max_bs, args.max_running_requests),
                                    CompileCapture(runner.kv_pool, runner.attn_backend))
    elif args.enable_torch_compile:
        logger.warning("--enable-torch-compile off: it applies to CPU at TP 1 (here %s, TP %d)", device, tp.size)
    if device.type == "cuda" and not args.disable_cuda_graph:
        if tp.size > 1:
            logger.warning("CUDA graphs off: not captured with tensor parallelism (collectives inside)")
        elif runner.attn_backend.graph_capturable:
            from common.model.cuda_graphs import CudaGraphCapture

            runner.enable_decode_graphs(args.cuda_graph_max_bs or args.max_running_requests, CudaGraphCapture(device))
        else:
            logger.warning("CUDA graphs off: the %s cannot be captured", type(runner.attn_backend).__name__)
    future_capacity = 4 * (req_pool.max_reqs + 8)
    sampler = Sampler(config.vocab_size, req_pool.max_reqs, device, streams=streams)
    worker = TorchModelWorker(runner, sampler, future_capacity=future_capacity)
    return RankWorker(
        model_path=model_path, config=config, device=device, dtype=dtype, context_length=context_length,
        req_pool=req_pool, runner=runner, worker=worker, future_capacity=future_capacity,
    )


def build_engine_core(
    args: ServerArgs,
    output: OutputSink,
    *,
    role: RoleSpec = COLOCATED,
    extra_req_rows: int = EXTRA_REQ_ROWS,
    on_worker_start: Callable[[], None] | None = None,
    publish_kv_events: bool = False,
    run_dir: str | None = None,
) -> EngineCore:
    """The overlap loop on CPU builds on a short-lived thread, so that the worker thread's
    OpenMP pool is the process's only one (intra_op.py: a second pool slows every step).
    run_dir: a private directory the TP ranks meet in (an instance's; None: a new one in /tmp)."""

    def build() -> EngineCore:
        return _build_engine_core(args, output, role=role, extra_req_rows=extra_req_rows,
                                  on_worker_start=on_worker_start, publish_kv_events=publish_kv_events,
                                  run_dir=run_dir)

    if args.overlap_schedule and args.resolved_device() == "cpu":
        return run_on_fresh_thread(build)
    return build()


def _build_engine_core(
    args: ServerArgs,
    output: OutputSink,
    *,
    role: RoleSpec,
    extra_req_rows: int,
    on_worker_start: Callable[[], None] | None,
    publish_kv_events: bool,
    run_dir: str | None = None,
) -> EngineCore:
    if not role.radix_cache and not args.disable_radix_cache:
        args = dataclasses.replace(args, disable_radix_cache=True)
    tp_ranks: TPRanks | None = None
    tp = NO_TP
    if args.tp_size > 1 and extra_req_rows != EXTRA_REQ_ROWS:
        raise ValueError("TP ranks build their req_to_token table with the default extra rows")
    if args.tp_size > 1:  # this process becomes rank 0 of tp_size
        tp_ranks = TPRanks(args, run_dir)
        tp_ranks.start()
    try:
        if tp_ranks is not None:
            device = resolve_device(args.device, args.base_gpu_id)
            set_rank_threads(device, args.tp_size)
            tp = init_tp_group(0, args.tp_size, tp_ranks.addrs, device, args.engine_start_timeout)
        kv_paths = tp_ranks.addrs.kv_pools if tp_ranks is not None else ()
        rw = build_rank_worker(args, tp, extra_req_rows, kv_shared_path=kv_paths[0] if kv_paths else None)
        tp.barrier()  # every rank has its shard loaded and its KV pool made
        if tp_ranks is not None:
            if rw.device.type == "cpu" and kv_paths:  # decode: retraction reads every rank's heads
                starts = [TPShard.of(rw.config, r, tp.size).kv_head_start for r in range(1, tp.size)]
                rw.runner.kv_pool.attach_rank_views(list(kv_paths[1:]), starts)
            # every rank has joined, connected and mapped: no file is needed any more, and none
            # is left behind when the instance is killed
            tp_ranks.addrs.remove_files()
            tp_ranks.started()  # from here a dead rank is the engine loop's business
    except BaseException:
        if tp_ranks is not None:
            tp_ranks.stop()
        raise
    runner, config, device, kv_pool = rw.runner, rw.config, rw.device, rw.runner.kv_pool
    logger.info(
        "KV pool: %d tokens (%d pages of %d), %.1f MiB, %s%s",
        (kv_pool.num_pages - 1) * kv_pool.page_size, kv_pool.num_pages - 1, kv_pool.page_size,
        kv_pool.total_bytes() / 2**20, str(rw.dtype).removeprefix("torch."),
        f" (TP rank 0 of {tp.size}: {kv_pool.num_kv_heads} KV heads)" if tp.size > 1 else "",
    )
    allocator = PageAllocator(kv_pool.num_pages, args.page_size)
    kv_events = None
    if not args.disable_radix_cache and not args.disable_kv_events and publish_kv_events:
        kv_events = KVEventPublisher(args.host, args.kv_events_port, args.page_size,
                                     secret=ClusterSecret.load(args.cluster_secret_file))
    radix = RadixCache(allocator, args.page_size, disable=args.disable_radix_cache, events=kv_events)
    kv = ReqKVManager(allocator, radix, rw.req_pool, defer_frees=role.defer_frees)
    worker: SplitWorker[LaunchedStep] = rw.worker if tp_ranks is None else TPLeaderWorker(rw.worker, tp_ranks.fanout)

    def on_thread_start() -> None:  # the worker's device and stream, then the caller's hook
        rw.worker.on_thread_start()
        if on_worker_start is not None:
            on_worker_start()

    executor = make_executor(args, worker, device, on_thread_start)
    cfg = scheduler_config(args, rw.context_length)
    built = role.build(
        SchedulerParts(cfg=cfg, executor=executor, kv=kv, kv_pool=kv_pool, future_capacity=rw.future_capacity,
                       output=output, kv_link=tp_ranks.addrs.kv_link if tp_ranks is not None else "")
    )
    if args.grammar_backend == "xgrammar":
        tokenizer_path = args.tokenizer_path or rw.model_path
        built.scheduler.attach_grammar_backend(GrammarBackend(
            lambda: load_tokenizer(tokenizer_path), config.vocab_size, list(config.eos_token_ids)))
    return EngineCore(
        args=args, model_path=rw.model_path, model_config=config, kv_pool=kv_pool, role=role,
        scheduler=built.scheduler, transfer=built.transfer, executor=executor, runner=runner, kv_events=kv_events,
        tp_ranks=tp_ranks, heap_trimmer=HeapTrimmer(args.malloc_trim_interval),
    )
