"""Load: more concurrent long-prompt chats than the instances serve at once, through the router
over 1 prefill + 1 decode (real processes, tiny model, fp32). Every chat succeeds and the
router never marks a worker down.

The shape of issue 24's bench_serving run (generated-shared-prefix: groups of chats sharing
a long system prompt), scaled to the tiny model. Every prefill step after the readiness
round trip is made SLOW_STEP_S longer by the engine fault hook, longer than the router's
probe timeout (0.5 s): a /health that waited for a step would time out on every probe.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import httpx

from tests.pd.pd_procs import start_pair
from tests.router.router_procs import ADMIN, RouterProc

FLAGS = ["--page-size", "16", "--max-total-tokens", "4096", "--max-running-requests", "4"]
PROBES = ["--health-check-interval", "0.2", "--health-check-timeout", "0.5"]
SLOW_STEP_S = 0.6
GROUPS, CHATS_PER_GROUP = 3, 2  # 6 chats at once; each instance runs at most 4
RULES_PER_PROMPT = 12  # ~460 tokens of system prompt with the tiny tokenizer
MAX_TOKENS = 8


def system_prompt(group: int) -> str:
    return " ".join(f"group {group} rule {i}: always answer with care and cite the source." for i in range(RULES_PER_PROMPT))


def chats() -> list[dict[str, Any]]:
    return [
        {"messages": [{"role": "system", "content": system_prompt(g)},
                      {"role": "user", "content": f"Question {c} of group {g}: what does rule {c} say?"}],
         "max_tokens": MAX_TOKENS, "temperature": 0}
        for g in range(GROUPS) for c in range(CHATS_PER_GROUP)
    ]


def metric_sum(text: str, name: str, label_filter: str = "") -> float:
    pattern = rf'^{name}\{{[^}}]*{label_filter}[^}}]*\}} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, text, re.M))


async def run_load(router: RouterProc, prefill_url: str) -> tuple[list[httpx.Response], int]:
    """All chats at once; meanwhile the most requests the router had in flight at the prefill."""
    most = 0
    async with httpx.AsyncClient(timeout=180.0) as client:
        tasks = [asyncio.ensure_future(client.post(router.url + "/v1/chat/completions", json=body))
                 for body in chats()]
        while not all(t.done() for t in tasks):
            workers = (await client.get(router.url + "/workers", headers=ADMIN)).json()["workers"]
            most = max([most, *(w["in_flight_requests"] for w in workers if w["url"] == prefill_url)])
            await asyncio.wait(tasks, timeout=0.2)
        return [t.result() for t in tasks], most


def test_concurrent_long_chats_all_succeed_without_a_down_transition(tiny_llama_path: str) -> None:
    model = Path(tiny_llama_path)
    prefill_flags = [*FLAGS, "--chunked-prefill-size", "128", "--max-prefill-tokens", "256",
                     "--engine-fault-spec", f"slow_step_s={SLOW_STEP_S:g},after_steps=1"]
    pair = start_pair(model, prefill_flags, FLAGS)
    router = None
    try:
        router = RouterProc(model, ["--prefill", pair.prefill.url, str(pair.prefill.bootstrap_port),
                                    "--decode", pair.decode.url, *PROBES])
        router.wait_ready(timeout=60)
        responses, most_in_flight = asyncio.run(asyncio.wait_for(run_load(router, pair.prefill.url), 300))
        failed = [(r.status_code, r.text[:300]) for r in responses if r.status_code != 200]
        assert not failed, failed
        for r in responses:
            body = r.json()
            assert body["usage"]["prompt_tokens"] >= 400 and body["usage"]["completion_tokens"] == MAX_TOKENS
        assert most_in_flight > 4  # more than the instance serves at once was queued at it

        metrics = httpx.get(router.url + "/metrics", timeout=5.0).text
        assert metric_sum(metrics, "router_worker_health_transitions_total", 'to="down"') == 0, metrics
        assert metric_sum(metrics, "router_health_checks_total", 'result="ok"') > 0
        engine = httpx.get(pair.prefill.url + "/health", timeout=5.0).json()["engine"]
        assert engine["steps"] >= 5 and engine["last_step_s"] >= SLOW_STEP_S  # the prefill really was slow
    finally:
        if router is not None:
            router.stop()
        pair.stop()
