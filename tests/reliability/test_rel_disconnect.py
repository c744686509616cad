"""200 streaming requests through the router, each client hanging up at a random point
(before the response, after k events, or never): the requests that run to the end are
exact, and afterwards both roles and the router hold nothing (pools whole, no load)."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass
from typing import Any

import httpx

from tests.engine.reference import hf_greedy
from tests.reliability.cluster import VOCAB, Cluster

N_REQUESTS = 200
CONCURRENCY = 48
MAX_NEW = 24


@dataclass
class Plan:
    route: str
    body: dict[str, Any]
    prompt: list[int]
    hang_up_after_s: float | None  # before (or while) the response starts
    hang_up_after_events: int | None


@dataclass
class Seen:
    events: int = 0
    tokens: list[int] | None = None
    completed: bool = False


def make_plans(seed: int) -> list[Plan]:
    rng = random.Random(seed)
    plans = []
    for i in range(N_REQUESTS):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(4, 60))]
        route = ("/generate", "/v1/completions", "/v1/chat/completions")[i % 3]
        if route == "/generate":
            body: dict[str, Any] = {"input_ids": prompt, "stream": True, "incremental_stream": True, "sampling_params": {
                "max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}}
        elif route == "/v1/completions":
            body = {"prompt": prompt, "stream": True, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
        else:
            body = {"messages": [{"role": "user", "content": f"tell me {i}"}], "stream": True, "max_tokens": MAX_NEW}
        mode = rng.random()
        after_s = rng.uniform(0.0, 0.3) if mode < 0.3 else None
        after_events = rng.randrange(0, MAX_NEW) if 0.3 <= mode < 0.8 else None
        plans.append(Plan(route, body, prompt, after_s, after_events))
    return plans


async def _stream(client: httpx.AsyncClient, url: str, plan: Plan, seen: Seen) -> None:
    async with client.stream("POST", url + plan.route, json=plan.body) as r:
        assert r.status_code == 200, await r.aread()
        tokens: list[int] = []
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                seen.completed = True
                break
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            assert "error" not in ev, ev
            seen.events += 1
            tokens += ev.get("output_ids", [])
            if plan.hang_up_after_events is not None and seen.events > plan.hang_up_after_events:
                return  # leaving the block closes the connection mid-stream
        seen.tokens = tokens


async def _run_all(url: str, plans: list[Plan]) -> list[Seen]:
    sem = asyncio.Semaphore(CONCURRENCY)
    seen = [Seen() for _ in plans]

    async def one(client: httpx.AsyncClient, plan: Plan, s: Seen) -> None:
        async with sem:
            if plan.hang_up_after_s is None:
                await _stream(client, url, plan, s)
                return
            try:
                await asyncio.wait_for(_stream(client, url, plan, s), plan.hang_up_after_s)
            except TimeoutError:
                pass

    limits = httpx.Limits(max_connections=CONCURRENCY * 2, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=60.0, limits=limits) as client:
        await asyncio.gather(*(one(client, p, s) for p, s in zip(plans, seen, strict=True)))
    return seen


def test_client_disconnects_free_everything(whole_cluster: Cluster, tiny_llama_path: str) -> None:
    c = whole_cluster
    failures_before = {u: w["total_failures"] for u, w in c.router.workers().items()}
    plans = make_plans(seed=81)
    seen = asyncio.run(_run_all(c.router.url, plans))
    hung_up = sum(1 for p, s in zip(plans, seen, strict=True) if not s.completed)
    assert hung_up >= N_REQUESTS // 3, f"only {hung_up} clients hung up early"
    full = [(p, s) for p, s in zip(plans, seen, strict=True) if s.completed and p.route == "/generate"]
    assert full, "no native request ran to the end"
    for plan, s in full[:8]:
        assert s.tokens == hf_greedy(tiny_llama_path, plan.prompt, MAX_NEW)
    c.wait_whole(timeout_s=30.0)
    after = {u: w["total_failures"] for u, w in c.router.workers().items()}
    assert after == failures_before, "a client disconnect was blamed on a worker"
