"""Overload gets a fast 503 with Retry-After, never an unbounded queue (issue 23, the router's part).

One prefill and one decode stub; the decode reports max_running_requests 16 on GET /get_load
and answers each request after DELAY_S, so the router can run 16 at once and queues the rest
(--max-queued-requests 32). 400 concurrent requests: the excess are refused at once with 503 +
Retry-After, every accepted one completes with the right tokens, and the decode never had more
than 16 at once. A second router (--queue-timeout 1) shows the 503 after the timeout.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.router.router_procs import RouterProc, StubWorker, pd_args
from tests.router.stub_worker import generate_ids
from tests.server.server_procs import wait_until

MAX_RUNNING, MAX_QUEUED, DELAY_S = 16, 32, 3.0


@dataclass
class Setup:
    p: StubWorker
    d: StubWorker
    router: RouterProc  # --max-queued-requests 32, no --queue-timeout
    short: RouterProc  # --max-queued-requests 2, --queue-timeout 1


@dataclass
class Answer:
    prompt: list[int]
    status: int
    elapsed_s: float
    done_at: float  # monotonic
    retry_after: str | None
    body: dict[str, object]


@pytest.fixture(scope="module")
def setup(tiny_llama_path: str) -> Iterator[Setup]:
    p = StubWorker("prefill", wait=False)
    d = StubWorker("decode", wait=False, max_running_requests=MAX_RUNNING, delay_s=DELAY_S)
    procs: list[StubWorker | RouterProc] = [p, d]
    try:
        p.wait_up()
        d.wait_up()
        common = ["--health-check-interval", "0.2", "--load-report-interval", "0.1"]
        r = RouterProc(tiny_llama_path, pd_args([p], [d], *common, "--max-queued-requests", str(MAX_QUEUED)))
        procs.append(r)
        short = RouterProc(tiny_llama_path, pd_args([p], [d], *common, "--max-queued-requests", "2",
                                                    "--queue-timeout", "1"))
        procs.append(short)
        for router in (r, short):
            router.wait_ready()
            assert wait_until(lambda rt=router: rt.workers()[d.url]["load_report"] is not None, 10.0), \
                "the router never got the decode's load report"
        yield Setup(p, d, r, short)
    finally:
        for proc in reversed(procs):
            proc.stop()


async def _post(host: str, port: int, prompt: list[int], timeout_s: float) -> Answer:
    """One POST /generate on its own connection, over raw asyncio streams: with 400 at once, an
    HTTP client library's own per-request work would dominate the latency measured here."""
    body = json.dumps({"input_ids": prompt, "sampling_params": {"max_new_tokens": 4}}).encode()
    head = (f"POST /generate HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    t0 = time.monotonic()
    async with asyncio.timeout(timeout_s):
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(head + body)
            raw = await reader.read(-1)
        finally:
            writer.close()
    done_at = time.monotonic()
    elapsed = done_at - t0
    head_raw, _, payload = raw.partition(b"\r\n\r\n")
    lines = head_raw.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    assert headers.get("transfer-encoding") != "chunked", "a JSON answer was expected"
    return Answer(prompt, int(lines[0].split()[1]), elapsed, done_at, headers.get("retry-after"), json.loads(payload))


async def _post_all(url: str, prompts: list[list[int]], timeout_s: float) -> list[Answer]:
    host, port = url.removeprefix("http://").split(":")
    return await asyncio.gather(*(_post(host, int(port), pr, timeout_s) for pr in prompts))


def _prompts(n: int, salt: int) -> list[list[int]]:
    return [[salt, i % 250 + 1, i // 250 + 1] for i in range(n)]


def test_excess_gets_503_at_once_and_accepted_complete(setup: Setup) -> None:
    setup.d.reset()
    answers = asyncio.run(_post_all(setup.router.url, _prompts(400, 3), timeout_s=120.0))
    ok = [a for a in answers if a.status == 200]
    refused = [a for a in answers if a.status != 200]
    assert len(ok) + len(refused) == 400
    assert len(ok) >= MAX_RUNNING + MAX_QUEUED, f"only {len(ok)} accepted"
    assert len(refused) >= 400 - 2 * (MAX_RUNNING + MAX_QUEUED), f"only {len(refused)} refused"
    for a in refused:
        assert a.status == 503 and a.retry_after is not None and int(a.retry_after) >= 1, a
        assert a.body["error"]["code"] == "queue_full", a  # type: ignore[index]
    # "At once": every refusal came while the first accepted requests still ran (DELAY_S each), so
    # none waited for room. On a quiet 2-core box they come within ~0.3 s; an ordering, not a clock.
    first_done = min(a.done_at for a in ok)
    assert max(a.done_at for a in refused) < first_done, "a 503 waited for queue room"
    for a in ok:
        assert a.body["output_ids"] == generate_ids(a.prompt, 4), a
    stats = setup.d.stats()
    assert stats["max_running"] <= MAX_RUNNING, "the router piled requests onto a full decode"
    assert stats["completed"] == len(ok) and stats["running"] == 0
    assert wait_until(lambda: all(w["in_flight_requests"] == 0 for w in setup.router.workers().values()), 10.0)
    metrics = httpx.get(setup.router.url + "/metrics").text
    assert f'router_queue_rejected_total{{reason="full"}} {float(len(refused))}' in metrics


def test_queue_timeout_gives_503(setup: Setup) -> None:
    setup.d.reset()
    setup.d.control(delay_s=4.0)  # past the short router's 1 s queue timeout
    try:
        answers = asyncio.run(_post_all(setup.short.url, _prompts(MAX_RUNNING + 3, 5), timeout_s=60.0))
    finally:
        setup.d.control(delay_s=DELAY_S)
    codes = sorted(str(a.body["error"]["code"]) for a in answers if a.status == 503)  # type: ignore[index]
    assert codes == ["queue_full", "queue_timeout", "queue_timeout"], [(a.status, a.body) for a in answers]
    for a in answers:
        if a.status == 503:
            assert a.retry_after is not None
            if a.body["error"]["code"] == "queue_timeout":  # type: ignore[index]
                assert a.elapsed_s >= 1.0
        else:
            assert a.status == 200 and a.body["output_ids"] == generate_ids(a.prompt, 4)
    assert setup.d.stats()["max_running"] <= MAX_RUNNING
