"""Security review 2, M3, against a real instance: /metrics was open and each scrape cost an
engine round trip (a StatsReq queued without bound, built between steps). Now scrapes share
one StatsReq in flight and are served the last answer while nothing changed, so 1,000
scrapes (in a row or 100 at once) cost the engine about one stats build per second; and an
operator can require a token (--metrics-token-file) that is neither the cluster secret nor
the router's keys."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.server_procs import ServerProcess

TOKEN = secrets.token_hex(16)
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SCRAPES = 1000
SENT = "pdserve_engine_stats_requests_total"


@pytest.fixture(scope="module")
def inst(long_ctx_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    token_file = tmp_path_factory.mktemp("metrics") / "metrics_token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    server = ServerProcess(long_ctx_model, "--metrics-token-file", str(token_file))
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def _sample(text: str, name: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_m3_a_scrape_flood_costs_about_one_stats_request_per_second(inst: ServerProcess) -> None:
    with httpx.Client(base_url=inst.url, headers=AUTH, timeout=10) as c:
        before, t0 = _sample(c.get("/metrics").text, SENT), time.monotonic()
        for _ in range(SCRAPES):
            r = c.get("/metrics")
            assert r.status_code == 200 and "pdserve_engine_up 1.0" in r.text
        in_a_row = _sample(c.get("/metrics").text, SENT) - before
        elapsed = time.monotonic() - t0

        async def at_once() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=inst.url, headers=AUTH, timeout=30) as ac:
                return await asyncio.gather(*(ac.get("/metrics") for _ in range(100)))

        mid, t1 = _sample(c.get("/metrics").text, SENT), time.monotonic()
        assert all(r.status_code == 200 for r in asyncio.run(at_once()))
        concurrent = _sample(c.get("/metrics").text, SENT) - mid
        elapsed_concurrent = time.monotonic() - t1
    assert in_a_row <= elapsed + 3, (in_a_row, elapsed)  # one per second (the refresh), not one per scrape
    assert concurrent <= elapsed_concurrent + 3, (concurrent, elapsed_concurrent)


def test_m3_metrics_token_is_required_when_set(inst: ServerProcess) -> None:
    assert httpx.get(inst.url + "/metrics", timeout=10).status_code == 401
    for wrong in (f"Bearer {TOKEN[:-1]}x", TOKEN, "Bearer x"):
        assert httpx.get(inst.url + "/metrics", headers={"Authorization": wrong}, timeout=10).status_code == 403
    assert httpx.get(inst.url + "/health", timeout=10).status_code == 200
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    assert httpx.post(inst.url + "/generate", json=body, timeout=60).status_code == 200
    text = httpx.get(inst.url + "/metrics", headers=AUTH, timeout=10).text
    assert _sample(text, "pdserve_requests_total") >= 1 and _sample(text, "pdserve_generation_tokens_total") >= 3
