"""1,000 requests at concurrency 64 through a router over the fast prefill and both decodes
then a burst of long outputs that must retract on the small decode: all complete, and every
greedy output equals the one the same prompt got when run alone (a sequential run of each
distinct prompt through the same router; greedy outputs of shorter requests are prefixes of
it), which in turn equals transformers for a sample."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from tests.engine.reference import hf_greedy
from tests.reliability.cluster import VOCAB, Cluster, Router
from tests.server.server_procs import wait_until

N_REQUESTS = 1000
CONCURRENCY = 64
N_PROMPTS = 100
MAX_NEW = 32
BURST_NEW = 200  # the burst: 8 short prompts growing to ~220 tokens each on the 640-token d_small


@pytest.fixture(scope="module")
def load_router(cluster: Cluster) -> Iterator[Router]:
    # no load reports: the router must not steer around a full d_small (the burst below exists
    # to make it retract), so it routes by its own in-flight counts as before admission existed
    r = Router(cluster.model_dir, [cluster.p_fast], [cluster.d_small, cluster.d_big],
               "--decode-policy", "round_robin", "--load-report-interval", "0")
    try:
        r.wait_ready()
        yield r
    finally:
        r.stop()


def distinct_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(40)]
    out = []
    for i in range(N_PROMPTS):
        body = [rng.randrange(3, VOCAB) for _ in range(rng.choice([1, 3, 8, 20, 45, 80, 120, 250]))]
        out.append(shared + body if i % 3 == 0 else body)
    return out


def _body(prompt: list[int], max_new: int, stream: bool) -> dict[str, Any]:
    # incremental_stream: events carry deltas (the router's /generate default is SGLang's cumulative)
    return {"input_ids": prompt, "stream": stream, "incremental_stream": True,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}


async def _generate(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[int]:
    async with session.post(url + "/generate", json=body) as r:
        assert r.status == 200, await r.text()
        if not body["stream"]:
            return list((await r.json())["output_ids"])
        tokens: list[int] = []
        async for raw in r.content:  # one SSE line at a time
            if raw.startswith(b"data: {"):
                ev = json.loads(raw[6:])
                assert "error" not in ev, ev
                tokens += ev["output_ids"]
        return tokens


async def _run(url: str, bodies: list[dict[str, Any]], concurrency: int) -> list[list[int]]:
    """aiohttp, not httpx: a third of the CPU per request in this process (1,000 requests here)."""
    sem = asyncio.Semaphore(concurrency)

    async def one(session: aiohttp.ClientSession, body: dict[str, Any]) -> list[int]:
        async with sem:
            return await _generate(session, url, body)

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120.0)) as session:
        return await asyncio.gather(*(one(session, b) for b in bodies))


def test_load_outputs_equal_sequential(whole_cluster: Cluster, load_router: Router, tiny_llama_path: str) -> None:
    c = whole_cluster
    prompts = distinct_prompts(seed=91)
    alone = asyncio.run(_run(load_router.url, [_body(p, MAX_NEW, False) for p in prompts], concurrency=1))
    for prompt, out in list(zip(prompts, alone, strict=True))[:: N_PROMPTS // 10]:
        assert out == hf_greedy(tiny_llama_path, prompt, MAX_NEW)
    rng = random.Random(92)
    picks = [(rng.randrange(N_PROMPTS), rng.randint(1, MAX_NEW)) for _ in range(N_REQUESTS)]
    bodies = [_body(prompts[i], n, stream=k % 4 == 0) for k, (i, n) in enumerate(picks)]
    outs = asyncio.run(_run(load_router.url, bodies, CONCURRENCY))
    wrong = [(k, i, n) for k, ((i, n), out) in enumerate(zip(picks, outs, strict=True)) if out != alone[i][:n]]
    assert not wrong, f"{len(wrong)} outputs differ from the sequential run, e.g. {wrong[:5]}"

    # How hard the load presses d_small depends on how fast prefill feeds it (a slow machine
    # may never fill it). This burst retracts on any machine: 16 short prompts at once, 8 of
    # them on d_small, each growing by BURST_NEW tokens (three together already exceed 640).
    short = next(p for p in prompts if len(p) <= 20)
    [burst_alone] = asyncio.run(_run(load_router.url, [_body(short, BURST_NEW, False)], concurrency=1))
    assert burst_alone[:MAX_NEW] == alone[prompts.index(short)]
    retractions = c.d_small.stats()["num_retractions_total"]
    burst = asyncio.run(_run(load_router.url, [_body(short, BURST_NEW, k % 2 == 0) for k in range(16)], 16))
    assert all(out == burst_alone for out in burst), "a retracted request's output changed"
    assert c.d_small.stats()["num_retractions_total"] > retractions, "the small decode never retracted"
    c.wait_whole()
    assert wait_until(load_router.idle, 10.0), load_router.workers()
