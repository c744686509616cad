"""The soak's mixed traffic (bench/soak.py): one drawn Job in, one Outcome per request out.

Kinds (weights in MIX): completion and chat, each streamed or not; `cancel` streams and closes
the connection after a few content chunks (the client walked away); `overlong` sends a prompt
longer than the model's context and expects 400; `multiturn` is one chat conversation of
TURNS requests, each turn carrying the previous answers. Every request sends ignore_eos, so a
finished request must report exactly max_tokens completion tokens; anything else is a failure
with its reason (HTTP status and body, SSE error event, short output, transport error).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from serving_client import sse_events

MIX = {"completion": 20, "completion_stream": 20, "chat": 15, "chat_stream": 20, "cancel": 10,
       "overlong": 5, "multiturn": 10}
TURNS = 3
CANCEL_AFTER_CHUNKS = 3
WORDS = ("time person year way day thing man world life hand part child eye woman place work week case "
         "point government company number group problem fact river stone light garden music paper "
         "engine window market letter summer winter morning evening history science animal forest "
         "ocean mountain city village road bridge table chair kitchen doctor teacher student").split()


@dataclass(frozen=True)
class TrafficShape:
    min_words: int = 32
    max_words: int = 400
    min_out: int = 8
    max_out: int = 48
    context_tokens: int = 2048  # the served model's max_model_len: overlong prompts exceed it


@dataclass(frozen=True)
class Job:
    """One drawn unit of work: `turns` requests of `kind` (1 unless multiturn)."""

    index: int
    kind: str
    prompts: tuple[str, ...]
    max_tokens: tuple[int, ...]


@dataclass
class Outcome:
    index: int
    kind: str
    turn: int
    ok: bool
    status: int = 0
    error: str = ""
    start: float = 0.0
    seconds: float = 0.0
    completion_tokens: int = 0
    text: str = field(default="", repr=False)


def draw_job(rng: random.Random, index: int, shape: TrafficShape) -> Job:
    kind = rng.choices(list(MIX), weights=list(MIX.values()))[0]

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    if kind == "overlong":
        return Job(index, kind, (words(shape.context_tokens + 64),), (8,))
    turns = TURNS if kind == "multiturn" else 1
    prompts = tuple(words(rng.randint(shape.min_words, shape.max_words) // turns) for _ in range(turns))
    outs = tuple(rng.randint(shape.min_out, shape.max_out) for _ in range(turns))
    if kind == "cancel":
        outs = (max(outs[0], 4 * CANCEL_AFTER_CHUNKS),)
    return Job(index, kind, prompts, outs)


class TrafficClient:
    """Sends Jobs to one router; owns its httpx client (close with aclose)."""

    def __init__(self, base_url: str, model: str, timeout_s: float, api_key: str | None = None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(base_url=base_url, timeout=timeout_s, headers=headers,
                                      limits=httpx.Limits(max_connections=256, max_keepalive_connections=32))
        self.model = model

    async def aclose(self) -> None:
        await self.http.aclose()

    async def run(self, job: Job) -> list[Outcome]:
        if job.kind == "multiturn":
            messages: list[dict[str, str]] = []
            out = []
            for turn, (prompt, n) in enumerate(zip(job.prompts, job.max_tokens, strict=True)):
                messages.append({"role": "user", "content": prompt})
                o = await self._one(job.index, "multiturn", turn, {"messages": list(messages)}, n,
                                    chat=True, stream=turn % 2 == 1)
                messages.append({"role": "assistant", "content": o.text})
                out.append(o)
            return out
        chat = job.kind.startswith("chat") or job.kind == "cancel"
        body: dict[str, Any] = ({"messages": [{"role": "user", "content": job.prompts[0]}]} if chat
                                else {"prompt": job.prompts[0]})
        stream = job.kind.endswith("_stream") or job.kind == "cancel"
        return [await self._one(job.index, job.kind, 0, body, job.max_tokens[0], chat=chat, stream=stream)]

    async def _one(self, index: int, kind: str, turn: int, body: dict[str, Any], max_tokens: int, *,
                   chat: bool, stream: bool) -> Outcome:
        o = Outcome(index, kind, turn, ok=False, start=time.time())
        path = "/v1/chat/completions" if chat else "/v1/completions"
        payload = {**body, "model": self.model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                   "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
        t0 = time.perf_counter()
        try:
            if stream:
                await self._stream(o, path, payload, max_tokens, chat)
            else:
                await self._plain(o, path, payload, max_tokens, chat)
        except httpx.HTTPError as e:
            o.error = f"transport: {type(e).__name__}: {e}"
        o.seconds = time.perf_counter() - t0
        return o

    async def _plain(self, o: Outcome, path: str, payload: dict[str, Any], max_tokens: int, chat: bool) -> None:
        r = await self.http.post(path, json=payload)
        o.status = r.status_code
        if o.kind == "overlong":
            o.ok = r.status_code == 400
            o.error = "" if o.ok else f"overlong prompt answered {r.status_code}: {r.text[:200]}"
            return
        if r.status_code != 200:
            o.error = f"HTTP {r.status_code}: {r.text[:300]}"
            return
        data = r.json()
        choice = data["choices"][0]
        o.text = choice["message"]["content"] if chat else choice["text"]
        o.completion_tokens = int(data.get("usage", {}).get("completion_tokens", 0))
        self._judge(o, max_tokens)

    async def _stream(self, o: Outcome, path: str, payload: dict[str, Any], max_tokens: int, chat: bool) -> None:
        chunks = 0
        parts: list[str] = []
        done = False
        async with self.http.stream("POST", path, json=payload) as r:
            o.status = r.status_code
            if r.status_code != 200:
                o.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return
            async for event in sse_events(r):
                if event is None:
                    done = True
                    break
                if "error" in event:
                    o.error = f"SSE error event: {json.dumps(event['error'])[:300]}"
                    return
                if event.get("usage"):
                    o.completion_tokens = int(event["usage"].get("completion_tokens", 0))
                for c in event.get("choices", []):
                    piece = (c.get("delta") or {}).get("content") if chat else c.get("text")
                    if piece:
                        chunks += 1
                        parts.append(piece)
                if o.kind == "cancel" and chunks >= CANCEL_AFTER_CHUNKS:
                    o.ok = True  # leaving the block closes the connection mid-stream
                    return
        o.text = "".join(parts)
        if o.kind == "cancel":
            o.error = f"stream ended after {chunks} chunks, before the client could cancel it"
        elif not done:
            o.error = "stream ended without [DONE]"
        else:
            self._judge(o, max_tokens)

    @staticmethod
    def _judge(o: Outcome, max_tokens: int) -> None:
        o.ok = o.completion_tokens == max_tokens
        if not o.ok:
            o.error = f"{o.completion_tokens} completion tokens, asked for {max_tokens} with ignore_eos"
