"""Aborts (client disconnects) in each state on each side of a real 1P1D pair.

Prefill posts are slowed by the fault injector (delay_ms) so a request stays in the
transfer states long enough to be cut there; decode runs one request at a time, each of its
steps at least DECODE_STEP_S long, so a long request surely holds the second one in the
prealloc queue. After every scenario both pools are whole.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.pd.pd_procs import PDPair, RoleProcess, start_pair
from tests.server.server_procs import wait_until

DELAY_MS = 400
DECODE_STEP_S = 0.02  # the 900-token hog decodes for >= 18 s, however fast the box


@pytest.fixture(scope="module")
def pair(tiny_llama_path: str) -> Iterator[PDPair]:
    p = start_pair(
        Path(tiny_llama_path),
        ["--page-size", "4", "--chunked-prefill-size", "8", "--max-total-tokens", "4096",
         "--disaggregation-fault-spec", f"delay_ms={DELAY_MS}"],
        ["--page-size", "4", "--max-total-tokens", "2048", "--max-running-requests", "1",
         "--engine-fault-spec", f"slow_step_s={DECODE_STEP_S}"],
    )
    try:
        yield p
    finally:
        p.stop()


async def decode_stream(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    async with client.stream("POST", url + "/generate", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return [r.json()]
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    return events


async def prefill_call(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    r = await client.post(url + "/generate", json={**body, "stream": False})
    return r.status_code, r.json()


def wait_stat(role: RoleProcess, name: str, value: float, timeout_s: float = 15.0) -> None:
    assert wait_until(lambda: role.stat(name) == value, timeout_s, 0.05), (name, role.stat(name))


async def _cut(pair: PDPair, body: dict[str, Any], *, cut: str, when: Any) -> Any:
    """Run both sides; cancel (disconnect) side `cut` once `when()` holds; return the other side's result."""
    async with httpx.AsyncClient(timeout=60) as client:
        p = asyncio.create_task(prefill_call(client, pair.prefill.url, body))
        d = asyncio.create_task(decode_stream(client, pair.decode.url, body))
        deadline = time.monotonic() + 20
        while not await asyncio.to_thread(when):
            assert time.monotonic() < deadline, "the request never reached the state"
            await asyncio.sleep(0.05)
        victim, other = (d, p) if cut == "decode" else (p, d)
        victim.cancel()
        await asyncio.gather(victim, return_exceptions=True)
        return await other


def test_decode_abort_while_transferring(pair: PDPair) -> None:
    body = pair.body(list(range(5, 25)), 8)
    status, resp = asyncio.run(_cut(pair, body, cut="decode",
                                    when=lambda: pair.decode.stat("num_transfer_queue_reqs") == 1))
    # Prefill reports the transfer decode gave up on, as not its own fault (a router won't blame it).
    assert status == 499 and resp["error"]["type"] == "aborted", (status, resp)
    pair.wait_whole(timeout_s=40)  # decode held the pages until prefill's drain ack


def test_prefill_abort_while_transferring(pair: PDPair) -> None:
    body = pair.body(list(range(30, 90)), 8)  # 8 chunk sends, each post delayed: a wide window
    events = asyncio.run(_cut(pair, body, cut="prefill",
                              when=lambda: pair.prefill.stat("num_inflight_queue_reqs") == 1))
    assert events and "error" in events[-1], events  # decode's client gets an error, not a hang
    pair.wait_whole(timeout_s=40)


def test_prefill_abort_while_bootstrapping(pair: PDPair) -> None:
    body = pair.body(list(range(60, 70)), 4)

    async def main() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            task = asyncio.create_task(prefill_call(client, pair.prefill.url, body))  # no decode side at all
            await asyncio.to_thread(wait_stat, pair.prefill, "num_bootstrap_queue_reqs", 1)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    wait_stat(pair.prefill, "num_bootstrap_queue_reqs", 0)
    pair.wait_whole()


def test_decode_abort_in_prealloc_and_while_running(pair: PDPair) -> None:
    hog = pair.body(list(range(100, 180)), 900)  # decodes >= 18 s; decode admits one request
    target = pair.body(list(range(200, 260)), 4)

    async def main() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=60) as client:
            hog_p = asyncio.create_task(prefill_call(client, pair.prefill.url, hog))
            hog_d = asyncio.create_task(decode_stream(client, pair.decode.url, hog))
            await asyncio.to_thread(wait_stat, pair.decode, "num_running_reqs", 1, 30)
            t_p = asyncio.create_task(prefill_call(client, pair.prefill.url, target))
            t_d = asyncio.create_task(decode_stream(client, pair.decode.url, target))
            await asyncio.to_thread(wait_stat, pair.decode, "num_prealloc_queue_reqs", 1)
            t_d.cancel()  # abort in prealloc: no pages were reserved
            await asyncio.gather(t_d, return_exceptions=True)
            await asyncio.to_thread(wait_stat, pair.decode, "num_prealloc_queue_reqs", 0)
            status, resp = await t_p  # prefill's side of the target fails (decode gave up on the room)
            assert status >= 400 and "error" in resp, (status, resp)
            hog_d.cancel()  # abort while decoding
            await asyncio.gather(hog_d, return_exceptions=True)
            return [await hog_p]  # type: ignore[list-item]

    (hog_prefill,) = asyncio.run(main())
    assert hog_prefill[0] == 200
    pair.wait_whole(timeout_s=40)
    # the pair still serves
    (res,) = pair.run([pair.body(list(range(7, 19)), 3)])
    assert res.error is None and len(res.output_ids) == 3
    pair.wait_whole()
