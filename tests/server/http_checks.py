"""HTTP-side checks shared by the frontend tests: strict SSE parsing, engine stats via /metrics."""

from __future__ import annotations

import json
from typing import Any

import httpx

from tests.server.server_procs import ServerProcess, wait_until


def parse_sse(raw: bytes) -> list[Any]:
    """Strict SSE parse: only `data: <json>\\n\\n` events, the last one `data: [DONE]`."""
    assert raw.endswith(b"\n\n"), raw[-50:]
    events = raw[:-2].split(b"\n\n")
    assert events[-1] == b"data: [DONE]", events[-1]
    out = []
    for event in events[:-1]:
        assert event.startswith(b"data: ") and b"\n" not in event, event
        out.append(json.loads(event[len(b"data: ") :]))
    return out


def engine_stat(server: ServerProcess, name: str) -> float | None:
    text = httpx.get(server.url + "/metrics", timeout=5.0).text
    for line in text.splitlines():
        if line.startswith(f"pdserve_{name} "):
            return float(line.split()[1])
    return None


def wait_engine_stat(server: ServerProcess, name: str, timeout_s: float = 5.0) -> float:
    assert wait_until(lambda: engine_stat(server, name) is not None, timeout_s, period_s=0.1), (
        f"engine stat {name} never appeared")
    value = engine_stat(server, name)
    assert value is not None
    return value


async def generate_merged(client: httpx.AsyncClient, payload: dict[str, Any]) -> dict[str, Any]:
    """Non-streaming, or streaming merged into the non-streaming shape (and SSE checked)."""
    if not payload.get("stream"):
        resp = await client.post("/generate", json=payload)
        assert resp.status_code == 200, resp.text
        return dict(resp.json())
    resp = await client.post("/generate", json=payload)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(resp.content)
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    assert events[-1]["meta_info"]["finish_reason"] is not None
    assert [e["meta_info"]["completion_tokens"] for e in events] == sorted(
        e["meta_info"]["completion_tokens"] for e in events
    )
    merged = dict(events[-1])
    merged["text"] = "".join(e["text"] for e in events)
    merged["output_ids"] = [t for e in events for t in e["output_ids"]]
    if "output_token_logprobs" in events[-1]["meta_info"]:
        merged["meta_info"] = dict(events[-1]["meta_info"])
        merged["meta_info"]["output_token_logprobs"] = [
            x for e in events for x in e["meta_info"]["output_token_logprobs"]
        ]
        merged["meta_info"]["output_top_logprobs"] = [
            x for e in events for x in e["meta_info"]["output_top_logprobs"]
        ]
    return merged
