"""A client that plays the router towards a chosen (prefill, decode) pair, and runs batches of
requests in a background thread while a test kills, stops or probes instances.

Like the router it sends the same request and room to both roles at once and reads the
tokens from decode's stream; with `cancel_prefill` it closes prefill's connection as soon
as decode failed (the router does that), otherwise it waits for prefill's own verdict.
Every wait is bounded by the httpx timeout.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.reliability.procs import Instance


@dataclass
class Side:
    """One role's answer: HTTP status (0: no response), error body or connection error, when it ended."""

    status: int = 0
    error: str | None = None
    body: Any = None
    done_at: float | None = None
    cancelled: bool = False


@dataclass
class Outcome:
    prompt: list[int]
    max_new: int
    started: float
    prefill: Side = field(default_factory=Side)
    decode: Side = field(default_factory=Side)
    output_ids: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.decode.status == 200 and self.decode.error is None and len(self.output_ids) == self.max_new

    @property
    def failed(self) -> bool:
        return self.decode.error is not None or self.decode.status not in (0, 200)


def pd_body(prefill: Instance, prompt: list[int], max_new: int, *, stream: bool = True,
            room: int | None = None) -> dict[str, Any]:
    return {
        "input_ids": prompt, "stream": stream,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True},
        "bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port,
        "bootstrap_room": random.randrange(2**63) if room is None else room,
    }


async def _prefill(client: httpx.AsyncClient, p: Instance, body: dict[str, Any], side: Side) -> None:
    try:
        r = await client.post(p.url + "/generate", json={**body, "stream": False})
        side.status = r.status_code
        side.body = r.json()
        if r.status_code != 200:
            side.error = json.dumps(side.body)
        elif side.body["meta_info"]["finish_reason"]["type"] == "abort":
            side.error = json.dumps(side.body["meta_info"]["finish_reason"])
    except httpx.HTTPError as e:
        side.error = f"{type(e).__name__}: {e}"
    except asyncio.CancelledError:
        side.cancelled = True
        raise
    finally:
        side.done_at = time.monotonic()


async def _decode(client: httpx.AsyncClient, d: Instance, body: dict[str, Any], out: Outcome) -> None:
    side = out.decode
    try:
        async with client.stream("POST", d.url + "/generate", json=body) as r:
            side.status = r.status_code
            if r.status_code != 200:
                await r.aread()
                side.error = r.text
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    side.error = json.dumps(ev["error"])
                out.output_ids += ev.get("output_ids", [])
                fr = (ev.get("meta_info") or {}).get("finish_reason")
                if fr and fr.get("type") == "abort":
                    side.error = json.dumps(fr)
    except httpx.HTTPError as e:
        side.error = f"{type(e).__name__}: {e}"
    finally:
        side.done_at = time.monotonic()


async def pd_generate(client: httpx.AsyncClient, p: Instance, d: Instance, prompt: list[int], max_new: int, *,
                      cancel_prefill: bool = True, room: int | None = None) -> Outcome:
    body = pd_body(p, prompt, max_new, room=room)
    out = Outcome(prompt, max_new, time.monotonic())
    p_task = asyncio.ensure_future(_prefill(client, p, body, out.prefill))
    await _decode(client, d, body, out)
    if out.decode.error is not None and cancel_prefill and not p_task.done():
        p_task.cancel()
    await asyncio.gather(p_task, return_exceptions=True)
    return out


@dataclass
class Job:
    prefill: Instance
    decode: Instance
    prompt: list[int]
    max_new: int
    cancel_prefill: bool = True
    room: int | None = None


class Batch:
    """Jobs run concurrently in a background thread; `wait()` returns their outcomes in order."""

    def __init__(self, jobs: list[Job], timeout_s: float = 90.0) -> None:
        self.jobs = jobs
        self.timeout_s = timeout_s
        self.outcomes: list[Outcome] = []
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        async def main() -> list[Outcome]:
            limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
            async with httpx.AsyncClient(timeout=self.timeout_s, limits=limits) as client:
                return await asyncio.gather(*(pd_generate(client, j.prefill, j.decode, j.prompt, j.max_new,
                                                          cancel_prefill=j.cancel_prefill, room=j.room)
                                              for j in self.jobs))
        try:
            self.outcomes = asyncio.run(main())
        except BaseException as e:  # reported by wait()
            self.error = e

    def wait(self) -> list[Outcome]:
        self._thread.join(self.timeout_s + 30)
        assert not self._thread.is_alive(), "client batch hung past its timeout"
        if self.error is not None:
            raise self.error
        return self.outcomes


def run_jobs(jobs: list[Job], timeout_s: float = 90.0) -> list[Outcome]:
    return Batch(jobs, timeout_s).wait()


@dataclass
class RouterOutcome:
    prompt: list[int]
    max_new: int
    status: int = 0
    output_ids: list[int] = field(default_factory=list)
    error: str | None = None
    done_at: float | None = None
    finish_reason: str | None = None
    done_events: int = 0  # `data: [DONE]` lines


async def router_stream(client: httpx.AsyncClient, url: str, prompt: list[int], max_new: int,
                        sampling: dict[str, Any] | None = None, out: RouterOutcome | None = None) -> RouterOutcome:
    """One streaming native /generate through the router (greedy unless `sampling` says otherwise);
    errors (HTTP or in-band) are recorded, ids as they arrive (into `out` if given)."""
    out = out if out is not None else RouterOutcome(prompt, max_new)
    body = {"input_ids": prompt, "stream": True, "incremental_stream": True,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True, **(sampling or {})}}
    try:
        async with client.stream("POST", url + "/generate", json=body) as r:
            out.status = r.status_code
            if r.status_code != 200:
                await r.aread()
                out.error = r.text
                return out
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        out.error = json.dumps(ev["error"])
                    out.output_ids += ev.get("output_ids", [])
                    fr = (ev.get("meta_info") or {}).get("finish_reason")
                    if fr:
                        out.finish_reason = fr.get("type")
                elif line == "data: [DONE]":
                    out.done_events += 1
    except httpx.HTTPError as e:
        out.error = f"{type(e).__name__}: {e}"
    finally:
        out.done_at = time.monotonic()
    return out


class RouterBatch:
    """Streaming requests through the router, concurrently, in a background thread."""

    def __init__(self, url: str, requests: list[tuple[list[int], int]], timeout_s: float = 90.0,
                 sampling: list[dict[str, Any] | None] | None = None) -> None:
        self.timeout_s = timeout_s
        self.outcomes: list[RouterOutcome] = []
        self.live = [RouterOutcome(p, n) for p, n in requests]  # filled while the streams run
        per_request = sampling or [None] * len(requests)

        async def main() -> list[RouterOutcome]:
            async with httpx.AsyncClient(timeout=timeout_s) as client:
                return await asyncio.gather(*(router_stream(client, url, o.prompt, o.max_new, sp, o)
                                              for o, sp in zip(self.live, per_request, strict=True)))

        self._thread = threading.Thread(target=lambda: self.outcomes.extend(asyncio.run(main())), daemon=True)
        self._thread.start()

    def wait(self) -> list[RouterOutcome]:
        self._thread.join(self.timeout_s + 30)
        assert not self._thread.is_alive(), "router batch hung past its timeout"
        return self.outcomes
