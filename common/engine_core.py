"""Assembles one engine: model runner + KV memory + scheduler, from ServerArgs.

Used by the offline Engine, the colocated engine process and the PD roles (which
pass their own Scheduler subclass). Nothing here runs a loop.

    ServerArgs -> ModelConfig, KVPool, ReqToTokenPool, PageAllocator, RadixCache
               -> ReqKVManager -> TorchModelWorker -> Sync/ThreadExecutor -> Scheduler
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from common.cache import PageAllocator, RadixCache, ReqToTokenPool
from common.cache.kv_pool import KVPool
from common.model.config import ModelConfig, resolve_dtype
from common.model.default_model import resolve_model_path
from common.model.model_runner import ModelRunner
from common.model.sampler import Sampler
from common.scheduler.config import SchedulerConfig
from common.scheduler.executor import Executor, SyncExecutor, ThreadExecutor
from common.scheduler.kv_manager import ReqKVManager
from common.scheduler.model_worker import TorchModelWorker
from common.scheduler.scheduler import OutputSink, Scheduler
from common.server.server_args import ServerArgs

logger = logging.getLogger(__name__)

EXTRA_REQ_ROWS = 8  # rows beyond max_running_requests (chunked request, requests being admitted)


@dataclass
class EngineCore:
    args: ServerArgs
    model_path: str
    model_config: ModelConfig
    kv_pool: KVPool
    scheduler: Any  # Scheduler or a role subclass
    executor: Executor
    runner: ModelRunner

    def shutdown(self) -> None:
        self.executor.shutdown()

    def ready_stats(self) -> dict[str, float]:
        s = self.scheduler.stats()
        s.update(
            {
                "max_total_tokens": float((self.kv_pool.num_pages - 1) * self.kv_pool.page_size),
                "kv_pool_bytes": float(self.kv_pool.total_bytes()),
                "context_length": float(self.model_config.context_length),
                "page_size": float(self.kv_pool.page_size),
                "vocab_size": float(self.model_config.vocab_size),
            }
        )
        return s


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


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


def kv_budget_tokens(args: ServerArgs, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> int:
    if args.max_total_tokens is not None:
        return args.max_total_tokens
    per_token = ModelRunner.kv_bytes_per_token(config, dtype, str(device))
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * args.mem_fraction_static)
    else:
        budget = int(args.kv_cache_gb * (1 << 30))
    return max(args.page_size, budget // per_token)


def build_engine_core(
    args: ServerArgs,
    output: OutputSink,
    *,
    scheduler_cls: type[Scheduler] = Scheduler,
    scheduler_kwargs: dict[str, Any] | None = None,
    extra_req_rows: int = EXTRA_REQ_ROWS,
    defer_frees: bool = False,
    on_worker_start: Callable[[], None] | None = None,
) -> EngineCore:
    model_path = resolve_model_path(args.model_path)
    config = ModelConfig.from_pretrained(model_path)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    context_length = min(args.context_length or config.context_length, config.context_length)
    total_tokens = kv_budget_tokens(args, config, dtype, device)
    kv_pool = ModelRunner.create_kv_pool(
        config, max_total_tokens=total_tokens, page_size=args.page_size, dtype=dtype, device=device
    )
    req_pool = ReqToTokenPool(args.max_running_requests + extra_req_rows, context_length + args.page_size, device=device)
    runner = ModelRunner(
        model_path, dtype=dtype, device=device, kv_pool=kv_pool, req_to_token=req_pool.table,
        attention_backend=args.attention_backend,
    )
    logger.info(
        "KV pool: %d tokens (%d pages of %d), %.1f MiB, %s",
        (kv_pool.num_pages - 1) * kv_pool.page_size, kv_pool.num_pages - 1, kv_pool.page_size,
        kv_pool.total_bytes() / 2**20, str(dtype).removeprefix("torch."),
    )
    allocator = PageAllocator(kv_pool.num_pages, args.page_size)
    radix = RadixCache(allocator, args.page_size, disable=args.disable_radix_cache)
    kv = ReqKVManager(allocator, radix, req_pool, defer_frees=defer_frees)
    future_capacity = 4 * (req_pool.max_reqs + 8)
    sampler = Sampler(config.vocab_size, req_pool.max_reqs, device)
    worker = TorchModelWorker(runner, sampler, future_capacity=future_capacity)
    executor: Executor
    if not args.overlap_schedule:
        executor = SyncExecutor(worker)
    else:
        executor = ThreadExecutor(worker, on_thread_start=on_worker_start)
    cfg = scheduler_config(args, context_length)
    scheduler = scheduler_cls(
        cfg, executor, kv, future_capacity=future_capacity, output=output, **(scheduler_kwargs or {})
    )
    return EngineCore(
        args=args, model_path=model_path, model_config=config, kv_pool=kv_pool, scheduler=scheduler,
        executor=executor, runner=runner,
    )
