"""Load generation for bench/serving.py: Poisson arrivals and/or a concurrency cap over one client.

Single-shot workloads: request i is dispatched at arrival time a_i (a_i - a_{i-1} ~ Exp(rate);
rate inf: all at t0), then waits for a concurrency slot. Multi-turn: conversations arrive that
way; the turns of one conversation run one after the other, each taking its own slot, and a
failed turn still feeds its (partial) answer to the next one so every turn is sent and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from serving_client import RequestRecord, StreamingClient
from serving_workloads import ConversationSpec, RequestInput, Workload


@dataclass(frozen=True)
class LoadConfig:
    request_rate: float = math.inf  # requests (or conversations) per second
    max_concurrency: int | None = None
    warmup_requests: int = 1
    seed: int = 0
    disable_tqdm: bool = False


@dataclass
class RunResult:
    records: list[RequestRecord]
    duration: float  # t0 (first dispatch) -> last request finished, seconds


class LoadRunner:
    """Drives one StreamingClient through one Workload; reusable across endpoints (same arrivals)."""

    def __init__(self, client: StreamingClient, cfg: LoadConfig) -> None:
        self.client = client
        self.cfg = cfg
        self.sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        self.t0 = 0.0
        self.bar: Any = None

    async def warmup(self, workload: Workload) -> None:
        """Send the first warmup inputs; raise RuntimeError if every one of them failed."""
        inputs = workload.warmup_inputs(self.cfg.warmup_requests)
        if not inputs:
            return
        t0 = time.perf_counter()
        recs = await asyncio.gather(*(self.client.send(r, -1 - i, t0) for i, r in enumerate(inputs)))
        failed = [r for r in recs if not r.success]
        if len(failed) == len(recs):
            raise RuntimeError(f"all {len(recs)} warmup requests failed; first error: {failed[0].error}")
        for r in failed:
            print(f"warning: a warmup request failed: {r.error}", file=sys.stderr)

    async def run(self, workload: Workload) -> RunResult:
        await self.warmup(workload)
        self.bar = _progress(workload.num_requests, self.cfg.disable_tqdm)
        self.t0 = time.perf_counter()
        tasks: list[asyncio.Task[list[RequestRecord]]] = []
        units: list[RequestInput] | list[ConversationSpec] = workload.requests or workload.conversations
        try:
            async for i in self._arrivals(len(units)):
                unit = units[i]
                coro = self._one(unit, i) if isinstance(unit, RequestInput) else self._conversation(unit, i)
                tasks.append(asyncio.create_task(coro))
            groups = await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            if self.bar is not None:
                self.bar.close()
        duration = time.perf_counter() - self.t0
        records = sorted((r for g in groups for r in g), key=lambda r: (r.index, r.turn))
        return RunResult(records, duration)

    async def _arrivals(self, n: int) -> AsyncIterator[int]:
        rng = random.Random(self.cfg.seed)
        rate = self.cfg.request_rate
        due = 0.0
        for i in range(n):
            if i > 0 and math.isfinite(rate):
                due += rng.expovariate(rate)
                delay = self.t0 + due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            yield i

    async def _send(self, req: RequestInput, index: int, turn: int) -> RequestRecord:
        async with self.sem if self.sem is not None else contextlib.nullcontext():
            rec = await self.client.send(req, index, self.t0, turn)
        if self.bar is not None:
            self.bar.update(1)
        return rec

    async def _one(self, req: RequestInput, index: int) -> list[RequestRecord]:
        return [await self._send(req, index, 0)]

    async def _conversation(self, conv: ConversationSpec, index: int) -> list[RequestRecord]:
        answers: list[tuple[str, int]] = []
        out = []
        for k in range(conv.turns):
            rec = await self._send(conv.turn(k, answers), index, k)
            answers.append((rec.generated_text, rec.output_tokens))
            out.append(rec)
        return out


def _progress(total: int, disable: bool) -> Any:
    if disable:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", file=sys.stderr)
