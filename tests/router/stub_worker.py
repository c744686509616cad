"""A fake instance speaking docs/generate_api.md with deterministic tokens (router tests and bench).

Started as a real uvicorn process: `main(["--port", P, "--role", "decode", ...])`.
Tokens: output i of a request is `token_at(input_ids, i)`; its text is " w<id>".
Roles: prefill answers meta only (text "", output_ids []); prefill and decode
require the bootstrap fields, colocated refuses them (so a leak is a 400).

Behaviour can be changed at runtime with POST /stub/control (fields of Behavior);
GET /stub/stats returns counters (generate requests, aborted by the client, rooms...).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

VOCAB = 300


def next_token(context: list[int]) -> int:
    """A stub "greedy model": the next token is a function of the context alone, so a request
    re-issued with prompt + its first k tokens goes on with the same tokens (migration)."""
    return (sum(context[-4:]) * 31 + len(context) * 7) % (VOCAB - 10) + 10


def generate_ids(input_ids: list[int], n: int) -> list[int]:
    ctx = list(input_ids)
    for _ in range(n):
        ctx.append(next_token(ctx))
    return ctx[len(input_ids):]


def token_at(input_ids: list[int], i: int) -> int:
    return generate_ids(input_ids, i + 1)[i]


def token_text(t: int) -> str:
    return f" w{t}"


@dataclass
class Behavior:
    fail_status: int | None = None  # answer /generate with this status ...
    fail_count: int = -1  # ... for this many requests (-1: all)
    delay_s: float = 0.0  # before the first byte / the response
    token_delay_s: float = 0.0  # between streamed tokens
    die_after_tokens: int | None = None  # stream N tokens, then kill the process
    error_after_tokens: int | None = None  # stream N tokens, then an in-band error event
    health_status: int = 200
    bootstrap_port: int | None = None  # reported in /server_info (prefill)
    events_per_token: bool = True  # False: one event with all tokens
    max_running_requests: int = 0  # reported by GET /get_load (0: no limit)
    kv_total_tokens: int = 1 << 20  # reported by GET /get_load
    load_status: int = 200  # GET /get_load answers this status (not 200: no report)
    load_delay_s: float = 0.0  # before GET /get_load answers


@dataclass
class Stats:
    generate: int = 0
    health: int = 0
    completed: int = 0
    aborted: int = 0
    failed: int = 0
    rooms: list[int] = field(default_factory=list)
    rids: list[str] = field(default_factory=list)
    aborted_rids: list[str] = field(default_factory=list)
    header_rids: list[str] = field(default_factory=list)
    inputs: list[list[int]] = field(default_factory=list)
    last_body: dict[str, Any] | None = None
    running: int = 0  # /generate requests in progress
    max_running: int = 0  # the most at once


def build_app(role: str, behavior: Behavior) -> FastAPI:
    app = FastAPI()
    initial = dataclasses.replace(behavior)
    state = {"b": behavior, "s": Stats()}

    def err(status: int, message: str, type_: str = "internal_error") -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": type_, "code": status}}, status_code=status)

    @app.get("/health")
    async def health() -> Response:
        state["s"].health += 1
        return Response(status_code=state["b"].health_status)

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        return {"disaggregation_mode": role, "bootstrap_port": state["b"].bootstrap_port, "context_length": 1024}

    @app.get("/get_load")
    async def get_load() -> Any:
        b: Behavior = state["b"]
        if b.load_delay_s:
            await asyncio.sleep(b.load_delay_s)
        if b.load_status != 200:
            return err(b.load_status, "engine stats timed out", "service_unavailable")
        running = state["s"].running
        return {"num_running_reqs": running, "num_queued_reqs": 0, "num_queued_tokens": 0,
                "kv_free_tokens": b.kv_total_tokens, "kv_total_tokens": b.kv_total_tokens,
                "max_running_requests": b.max_running_requests, "prompt_tokens_total": 0, "step_seconds_total": 0.0}

    @app.post("/stub/control")
    async def control(request: Request) -> dict[str, Any]:
        b = state["b"]
        for k, v in (await request.json()).items():
            assert hasattr(b, k), k
            setattr(b, k, v)
        return dataclasses.asdict(b)

    @app.get("/stub/stats")
    async def stats() -> dict[str, Any]:
        return dataclasses.asdict(state["s"])

    @app.post("/stub/reset")
    async def reset() -> dict[str, Any]:
        state["s"] = Stats()
        return {}

    @app.post("/stub/restore")
    async def restore() -> dict[str, Any]:
        """As started: the behavior it was given and fresh stats (a pooled stub's next test)."""
        state["b"], state["s"] = dataclasses.replace(initial), Stats()
        return {}

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        s: Stats = state["s"]
        s.running += 1
        s.max_running = max(s.max_running, s.running)

        def done() -> None:
            s.running -= 1

        try:
            resp = await _generate(request)
        except BaseException:
            done()
            raise
        if isinstance(resp, _StreamThenCount):
            first = resp.after
            resp.after = lambda: (first(), done())  # type: ignore[assignment, func-returns-value]
        else:
            done()
        return resp

    async def _generate(request: Request) -> Response:
        b: Behavior = state["b"]
        s: Stats = state["s"]
        body = json.loads(await request.body())
        s.generate += 1
        s.last_body = body
        s.rids.append(body.get("rid", ""))
        s.header_rids.append(request.headers.get("x-request-id", ""))
        s.inputs.append(body.get("input_ids", []))
        has_boot = all(k in body for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room"))
        if has_boot:
            s.rooms.append(body["bootstrap_room"])
        if (role == "colocated") == has_boot:
            return err(400, f"bootstrap fields {'not ' if has_boot else ''}expected on a {role} worker", "bad")
        if b.fail_status is not None and b.fail_count != 0:
            b.fail_count -= 1 if b.fail_count > 0 else 0
            if b.delay_s and not await _sleep_unless_gone(request, b.delay_s):
                s.aborted += 1
                s.aborted_rids.append(body.get("rid", ""))
                return Response(status_code=499)
            s.failed += 1
            return err(b.fail_status, f"stub failure {b.fail_status}")
        sp = body.get("sampling_params") or {}
        ids = body["input_ids"]
        n = 0 if role == "prefill" else int(sp.get("max_new_tokens", 128))
        tokens = generate_ids(ids, n)
        finish: dict[str, Any] = {"type": "length", "length": n}
        text = "".join(token_text(t) for t in tokens)
        for stop in sp.get("stop") or []:
            acc = ""
            for k, t in enumerate(tokens):
                acc += token_text(t)
                if stop in acc:
                    tokens, text = tokens[: k + 1], acc[: acc.index(stop)]
                    finish = {"type": "stop", "matched": stop}
                    break
            if finish["type"] == "stop":
                break
        meta_base = {"id": body.get("rid"), "prompt_tokens": len(ids), "cached_tokens": 0}
        want_lp = bool(body.get("return_logprob"))
        top_n = int(body.get("top_logprobs_num") or 0)

        def meta(done: list[int], new: list[int], final: bool) -> dict[str, Any]:
            m = dict(meta_base, completion_tokens=len(done) + len(new), finish_reason=finish if final else None)
            if want_lp:
                m["output_token_logprobs"] = [[-0.5, t] for t in new]
                if top_n:
                    m["output_top_logprobs"] = [[[-0.5, t]] + [[-1.0 - j, (t + j + 1) % VOCAB] for j in
                                                                 range(top_n - 1)] for t in new]
            return m

        if not body.get("stream"):
            if b.delay_s and not await _sleep_unless_gone(request, b.delay_s):
                s.aborted += 1
                s.aborted_rids.append(body.get("rid", ""))
                return Response(status_code=499)
            s.completed += 1
            out_ids = [] if role == "prefill" else tokens
            return JSONResponse({"text": text if role != "prefill" else "", "output_ids": out_ids,
                                 "meta_info": meta([], out_ids, True)})

        ended = False  # the stream ran to its end (tokens + [DONE], or an in-band error)

        async def events() -> AsyncIterator[bytes]:
            nonlocal ended
            if b.delay_s:
                await asyncio.sleep(b.delay_s)
            groups = [[t] for t in tokens] if b.events_per_token else [tokens]
            sent: list[int] = []
            if not groups:
                groups = [[]]
            for gi, group in enumerate(groups):
                if b.die_after_tokens is not None and len(sent) >= b.die_after_tokens:
                    await asyncio.sleep(0.05)
                    os._exit(1)
                if b.error_after_tokens is not None and len(sent) >= b.error_after_tokens:
                    s.failed += 1
                    yield b'data: {"error": {"message": "stub in-band failure", "type": "kv_transfer_failed",'
                    yield b' "code": 500}}\n\ndata: [DONE]\n\n'
                    ended = True
                    return
                final = gi == len(groups) - 1
                ev = {"text": "".join(token_text(t) for t in group), "output_ids": group,
                      "meta_info": meta(sent, group, final)}
                if final and finish["type"] == "stop":
                    ev["text"] = text[len("".join(token_text(t) for t in sent)):]
                sent += group
                yield b"data: " + json.dumps(ev).encode() + b"\n\n"
                if b.token_delay_s and not final:
                    await asyncio.sleep(b.token_delay_s)
            yield b"data: [DONE]\n\n"
            s.completed += 1
            ended = True

        def count_abort() -> None:
            if not ended:
                s.aborted += 1
                s.aborted_rids.append(body.get("rid", ""))

        return _StreamThenCount(events(), count_abort)

    return app


class _StreamThenCount(StreamingResponse):
    """Calls `after` once the response is over, however it ended. A client gone before the
    first chunk cancels the response before its generator ever starts, so the generator
    itself cannot count that abort."""

    def __init__(self, content: AsyncIterator[bytes], after: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.after = after

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.after()


async def _sleep_unless_gone(request: Request, seconds: float) -> bool:
    """Sleep; False if the client disconnected meanwhile."""
    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(gone())
    try:
        done, _ = await asyncio.wait({watch}, timeout=seconds)
        return not done
    finally:
        watch.cancel()


def main(argv: list[str]) -> None:
    import uvicorn

    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--role", choices=("prefill", "decode", "colocated"), required=True)
    p.add_argument("--behavior", default="{}", help="JSON object of Behavior fields")
    args = p.parse_args(argv)
    behavior = Behavior(**json.loads(args.behavior))
    uvicorn.run(build_app(args.role, behavior), host="127.0.0.1", port=args.port, log_level="warning",
                access_log=False, backlog=4096)
