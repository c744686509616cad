"""A tiny OpenAI-compatible (and native /generate) streaming server for bench/serving.py tests.

    python tests/bench/fake_openai_server.py --port P [--model-path DIR]

Each request streams max_tokens (max_new_tokens) content chunks " t<i>": `ttft_ms` before the
first, `itl_ms` between the others; usage rides on a final chunk when include_usage is set.
Requests without ignore_eos=true or a positive max_tokens get 400. Every `fail_every`-th
request (1-based arrival count) fails, rotating: HTTP 500, then an SSE error event after two
chunks, then a stream with no content. POST /fake/control {knobs} resets counters and sets
knobs; GET /fake/stats returns counters and the prompts received (text or ids, in order).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

DEFAULTS: dict[str, Any] = {"ttft_ms": 20.0, "itl_ms": 5.0, "fail_every": 0}


class FakeState:
    def __init__(self, model_path: str) -> None:
        self.model_path = model_path
        self.knobs = dict(DEFAULTS)
        self.reset()

    def reset(self) -> None:
        self.count = 0
        self.stats: dict[str, Any] = {"requests": 0, "http_500": 0, "sse_error": 0, "empty": 0, "ok": 0,
                                      "prompts": []}

    def failure(self) -> str | None:
        """Count an arrival; the failure mode it gets, if any."""
        self.count += 1
        self.stats["requests"] += 1
        every = int(self.knobs["fail_every"])
        if not every or self.count % every:
            return None
        return ("empty", "http_500", "sse_error")[(self.count // every) % 3]


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def build_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        return {"model_path": state.model_path, "served_model_name": "fake-model"}

    @app.post("/fake/control")
    async def control(req: Request) -> dict[str, Any]:
        state.knobs = dict(DEFAULTS, **(await req.json()))
        state.reset()
        return state.knobs

    @app.get("/fake/stats")
    async def stats() -> dict[str, Any]:
        return state.stats

    @app.post("/v1/completions")
    async def completions(req: Request) -> Response:
        body = await req.json()
        return await handle(body, body.get("prompt"), "text_completion", int(body.get("max_tokens") or 0),
                            bool(body.get("ignore_eos")))

    @app.post("/v1/chat/completions")
    async def chat(req: Request) -> Response:
        body = await req.json()
        return await handle(body, body.get("messages"), "chat.completion.chunk",
                            int(body.get("max_tokens") or 0), bool(body.get("ignore_eos")))

    @app.post("/generate")
    async def generate(req: Request) -> Response:
        body = await req.json()
        sp = body.get("sampling_params") or {}
        prompt = body.get("input_ids") or body.get("text")
        n = int(sp.get("max_new_tokens") or 0)
        return await handle(body, prompt, "native", n, bool(sp.get("ignore_eos")))

    async def handle(body: dict[str, Any], prompt: Any, kind: str, n: int, ignore_eos: bool) -> Response:
        if not ignore_eos or n < 1 or not body.get("stream"):
            return JSONResponse({"error": {"message": "need stream, ignore_eos and max_tokens >= 1"}}, 400)
        state.stats["prompts"].append(prompt)
        mode = state.failure()
        if mode == "http_500":
            state.stats["http_500"] += 1
            return JSONResponse({"error": {"message": "fake internal error", "type": "internal"}}, 500)
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        n_prompt = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
        return StreamingResponse(stream(kind, n, n_prompt, usage, mode), media_type="text/event-stream")

    async def stream(kind: str, n: int, n_prompt: int, usage: bool, mode: str | None) -> AsyncIterator[bytes]:
        if kind == "chat.completion.chunk":  # a role-only first chunk, as vLLM sends
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
            yield sse({"object": kind, "choices": [role]})
        await asyncio.sleep(state.knobs["ttft_ms"] / 1e3)
        sent = 0 if mode == "empty" else n
        for i in range(sent):
            if i:
                await asyncio.sleep(state.knobs["itl_ms"] / 1e3)
            if mode == "sse_error" and i == min(2, n - 1):
                state.stats["sse_error"] += 1
                yield sse({"error": {"message": "fake kv transfer failed", "type": "kv_transfer_failed"}})
                yield b"data: [DONE]\n\n"
                return
            yield chunk(kind, f" t{i}", i, n_prompt, i + 1, i == n - 1)
        state.stats["empty" if mode == "empty" else "ok"] += 1
        if usage and kind != "native":
            counts = {"prompt_tokens": n_prompt, "completion_tokens": sent, "total_tokens": n_prompt + sent}
            yield sse({"object": kind, "choices": [], "usage": counts})
        yield b"data: [DONE]\n\n"

    return app


def chunk(kind: str, text: str, token: int, n_prompt: int, done: int, last: bool) -> bytes:
    if kind == "native":
        meta = {"id": "fake", "finish_reason": {"type": "length"} if last else None,
                "prompt_tokens": n_prompt, "completion_tokens": done}
        return sse({"text": text, "output_ids": [token], "meta_info": meta})
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if last else None}
    if kind == "text_completion":
        choice["text"] = text
    else:
        choice["delta"] = {"content": text}
    return sse({"object": kind, "choices": [choice]})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model-path", default="")
    args = p.parse_args(argv)
    uvicorn.run(build_app(FakeState(args.model_path)), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
