"""Builders for scheduler tests with the fake model worker."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from common.cache import PageAllocator, RadixCache, ReqToTokenPool
from common.sampling_params import SamplingParams
from common.scheduler.config import SchedulerConfig
from common.scheduler.executor import Executor, LaunchExecutor, SyncExecutor, ThreadExecutor
from common.scheduler.fake_worker import FakeModelWorker
from common.scheduler.kv_manager import ReqKVManager
from common.scheduler.messages import TokenOut
from common.scheduler.req import Req
from common.scheduler.scheduler import Scheduler
from common.scheduler.sim_device import SimulatedDeviceWorker

VOCAB = 997
EOS = frozenset({3})
# make_harness(overlap=...): the normal loop, the overlap loop, and the overlap loop on one thread
# (LaunchExecutor) over a simulated device whose steps run on another thread, after launch returns
LOOPS = [True, False, "device"]


@dataclass
class Harness:
    scheduler: Scheduler
    worker: FakeModelWorker
    outputs: dict[str, list[TokenOut]] = field(default_factory=dict)

    def collect(self, items: list[TokenOut]) -> None:
        for it in items:
            self.outputs.setdefault(it.rid, []).append(it)

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outputs[rid] for t in o.new_token_ids]

    def final(self, rid: str) -> TokenOut:
        outs = self.outputs[rid]
        assert outs[-1].finish_reason is not None, f"{rid} did not finish"
        return outs[-1]

    def check(self) -> None:
        self.scheduler.kv.check_integrity()


def make_harness(
    *,
    page_size: int = 4,
    num_pages: int = 256,
    max_reqs: int = 64,
    overlap: bool | str = True,
    threaded: bool = False,
    step_delay_s: float = 0.0,
    **cfg_kwargs: object,
) -> Harness:
    cfg = SchedulerConfig(page_size=page_size, enable_overlap=bool(overlap), **cfg_kwargs)  # type: ignore[arg-type]
    allocator = PageAllocator(num_pages, page_size)
    radix = RadixCache(allocator, page_size, disable=cfg.disable_radix_cache)
    pool = ReqToTokenPool(max_reqs, cfg.context_length)
    kv = ReqKVManager(allocator, radix, pool)
    future_capacity = 4 * max_reqs + 8
    worker = FakeModelWorker(
        vocab_size=VOCAB, num_slots=num_pages * page_size, max_reqs=max_reqs, future_capacity=future_capacity,
        step_delay_s=step_delay_s,
    )
    executor: Executor
    if overlap == "device":
        executor = LaunchExecutor(SimulatedDeviceWorker(worker, host_s=0.0, device_s=0.0))
    else:
        executor = ThreadExecutor(worker) if threaded else SyncExecutor(worker)
    h = Harness(scheduler=None, worker=worker)  # type: ignore[arg-type]
    h.scheduler = Scheduler(cfg, executor, kv, future_capacity=future_capacity, output=h.collect)
    return h


def make_req(rid: str, prompt: list[int], max_new_tokens: int = 16, *, stream: bool = True, ignore_eos: bool = True, **kw: object) -> Req:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=ignore_eos)
    return Req(rid=rid, origin_input_ids=list(prompt), sampling_params=params, stream=stream, eos_token_ids=EOS, **kw)  # type: ignore[arg-type]


def mixed_workload(n: int, seed: int = 0, *, shared_prefix_len: int = 40, max_prompt: int = 120) -> list[tuple[str, list[int], int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(4, VOCAB) for _ in range(shared_prefix_len)]
    out = []
    for i in range(n):
        body = [rng.randrange(4, VOCAB) for _ in range(rng.randrange(1, max_prompt))]
        prompt = (shared + body) if i % 2 == 0 else body
        out.append((f"r{i}", prompt, rng.randrange(1, 40)))
    return out
