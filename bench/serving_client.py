"""Streaming clients for bench/serving.py: one request in, one RequestRecord out (never an exception).

    openai       POST /v1/completions       choices[0].text deltas, usage chunk (include_usage)
    openai-chat  POST /v1/chat/completions  choices[0].delta.content deltas, usage chunk
    native       POST /generate             docs/generate_api.md: text/output_ids deltas, meta_info

Timing (perf_counter, seconds): TTFT = first event carrying content, ITL = gaps between
content events, e2e = until the stream ends. A request fails (success False, error set) on
an HTTP error status, an SSE error event, an abort finish, a stream cut before [DONE],
empty output, or the per-request timeout.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import httpx
from serving_workloads import RequestInput

BACKENDS = ("openai", "openai-chat", "native")


async def sse_events(resp: httpx.Response) -> AsyncIterator[dict[str, Any] | None]:
    """The JSON events of a server-sent-events response, in order; None for `data: [DONE]`,
    after which it ends (a stream that ends without one never yields None)."""
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            yield None
            return
        yield json.loads(data)


@dataclass
class RequestRecord:
    """What one request measured; times in seconds, start relative to the benchmark's t0."""

    index: int
    input_len: int
    output_len: int  # requested (max_tokens)
    group: int = -1
    turn: int = 0
    success: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None  # from the endpoint, when it reports usage
    generated_text: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None

    @property
    def chunk_times(self) -> list[float]:
        """Arrival time of every content event, relative to t0."""
        times = [self.start + self.ttft]
        for gap in self.itl:
            times.append(times[-1] + gap)
        return times


class Delta(NamedTuple):
    """One parsed SSE event."""

    text: str = ""
    ids: int = 0  # token ids carried by this event (native only)
    completion_tokens: int | None = None  # cumulative, from usage / meta_info
    prompt_tokens: int | None = None
    error: str | None = None


class Protocol:
    """Request body and event parser of one backend."""

    path = ""

    def __init__(self, model: str | None, extra: dict[str, Any]) -> None:
        self.model = model
        self.extra = extra

    def body(self, req: RequestInput) -> dict[str, Any]:
        raise NotImplementedError

    def parse(self, ev: dict[str, Any]) -> Delta:
        raise NotImplementedError

    @staticmethod
    def event_error(ev: dict[str, Any]) -> str | None:
        err = ev.get("error")
        if err is None:
            return None
        return str(err.get("message", err)) if isinstance(err, dict) else str(err)


class OpenAICompletions(Protocol):
    path = "/v1/completions"

    def body(self, req: RequestInput) -> dict[str, Any]:
        return {"model": self.model, "prompt": req.text, **self._common(req)}

    def _common(self, req: RequestInput) -> dict[str, Any]:
        return {"max_tokens": req.output_len, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}, **self.extra}

    def parse(self, ev: dict[str, Any]) -> Delta:
        err = self.event_error(ev)
        usage = ev.get("usage") or {}
        choices = ev.get("choices") or []
        text = self._content(choices[0]) if choices else ""
        return Delta(text or "", 0, usage.get("completion_tokens"), usage.get("prompt_tokens"), err)

    def _content(self, choice: dict[str, Any]) -> str | None:
        return choice.get("text")


class OpenAIChat(OpenAICompletions):
    path = "/v1/chat/completions"

    def body(self, req: RequestInput) -> dict[str, Any]:
        return {"model": self.model, "messages": req.chat_messages(), **self._common(req)}

    def _content(self, choice: dict[str, Any]) -> str | None:
        return (choice.get("delta") or {}).get("content")


class Native(Protocol):
    path = "/generate"

    def body(self, req: RequestInput) -> dict[str, Any]:
        sp = {"max_new_tokens": req.output_len, "ignore_eos": True, **self.extra}
        prompt: dict[str, Any] = {"input_ids": list(req.input_ids)} if req.input_ids else {"text": req.text}
        return {**prompt, "sampling_params": sp, "stream": True, "incremental_stream": True}  # deltas

    def parse(self, ev: dict[str, Any]) -> Delta:
        err = self.event_error(ev)
        meta = ev.get("meta_info") or {}
        fr = meta.get("finish_reason")
        if err is None and isinstance(fr, dict) and fr.get("type") == "abort":
            err = f"aborted: {fr.get('message', '')}"
        return Delta(ev.get("text") or "", len(ev.get("output_ids") or []), meta.get("completion_tokens"),
                     meta.get("prompt_tokens"), err)


PROTOCOLS: dict[str, type[Protocol]] = {
    "openai": OpenAICompletions, "openai-chat": OpenAIChat, "native": Native,
}


class StreamingClient:
    """Sends RequestInputs to one endpoint; owns its httpx.AsyncClient (use `async with`)."""

    def __init__(self, base_url: str, backend: str, model: str | None, *, timeout: float = 600.0,
                 extra_body: dict[str, Any] | None = None, tokenizer: Any = None) -> None:
        self.url = base_url.rstrip("/") + PROTOCOLS[backend].path
        self.proto = PROTOCOLS[backend](model, extra_body or {})
        self.timeout = timeout
        self.tokenizer = tokenizer  # counts output tokens when the endpoint reports none
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(timeout, pool=None), limits=limits)

    async def __aenter__(self) -> StreamingClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()

    async def send(self, req: RequestInput, index: int, t0: float, turn: int = 0) -> RequestRecord:
        rec = RequestRecord(index, req.input_len, req.output_len, req.group, turn)
        start = time.perf_counter()
        rec.start = start - t0
        try:
            await asyncio.wait_for(self._stream(req, rec, start), self.timeout)
        except asyncio.TimeoutError:
            rec.error = f"timeout after {self.timeout:g} s"
        except httpx.HTTPError as e:
            rec.error = f"{type(e).__name__}: {e}"
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
            rec.error = f"bad response: {type(e).__name__}: {e}"
        rec.e2e = time.perf_counter() - start
        rec.success = not rec.error
        return rec

    async def _stream(self, req: RequestInput, rec: RequestRecord, start: float) -> None:
        async with self.http.stream("POST", self.url, json=self.proto.body(req)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {body[:500]}"
                return
            parts: list[str] = []
            last = start
            chunks = ids = 0
            done = False
            async for event in sse_events(resp):
                if event is None:
                    done = True
                    break
                d = self.proto.parse(event)
                if d.error is not None:
                    rec.error = f"stream error: {d.error}"
                    break
                if d.completion_tokens is not None:
                    rec.output_tokens = int(d.completion_tokens)
                if d.prompt_tokens is not None:
                    rec.prompt_tokens = int(d.prompt_tokens)
                if d.text or d.ids:
                    now = time.perf_counter()
                    if chunks == 0:
                        rec.ttft = now - start
                    else:
                        rec.itl.append(now - last)
                    last = now
                    chunks += 1
                    ids += d.ids
                    parts.append(d.text)
            rec.generated_text = "".join(parts)  # partial on failure: a multi-turn run still uses it
            if rec.error:
                return
            if not done:
                rec.error = "stream ended without [DONE]"
            elif chunks == 0:
                rec.error = "empty output"
            elif rec.output_tokens == 0:
                rec.output_tokens = ids or self._count(rec.generated_text) or chunks

    def _count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False)) if self.tokenizer is not None else 0


async def first_model_id(base_url: str, timeout: float = 10.0) -> str:
    """GET /v1/models -> the first model id; RuntimeError with the cause if there is none."""
    try:
        async with httpx.AsyncClient(timeout=timeout) as http:
            r = await http.get(base_url.rstrip("/") + "/v1/models")
            r.raise_for_status()
            data = r.json().get("data") or []
    except (httpx.HTTPError, ValueError) as e:
        raise RuntimeError(f"{base_url}/v1/models failed ({e}); pass --model") from e
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model")
    return str(data[0]["id"])
