"""The real instance (launcher + frontend process + engine process over ZMQ) on HTTP.

One module-scoped instance on the fake engine serves every test here except the
last, which stops it with SIGTERM and checks both processes are gone.
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

from common.server.server_args import ServerArgs
from tests.server.fake_engine import fake_logprob, fake_output_ids
from tests.server.http_checks import engine_stat, generate_merged, parse_sse, wait_engine_stat
from tests.server.server_procs import ServerProcess, pid_alive, wait_until

REQUEST_TIMEOUT_S = 2.0
# Every forward takes this much longer: a 1000-token request runs >= 5 s, past the request
# timeout and any client timeout below, however fast the box.
STEP_S = 0.005
CONTEXT = 1024  # the tiny checkpoint's max_position_embeddings


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    srv = ServerProcess(tiny_model_dir, "--request-timeout", str(REQUEST_TIMEOUT_S),
                        "--engine-fault-spec", f"slow_step_s={STEP_S}")
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Un deux trois, naïve café, 東京, München, emoji 🙂 ok.",
    "What is the capital of France?",
    "KV cache pages move from prefill to decode.",
]


def test_32_concurrent_requests_match_the_engine_tokens(server: ServerProcess, tokenizer: Any) -> None:
    cases = []
    for i in range(32):
        use_ids = i % 4 == 3
        prompt = PROMPTS[i % len(PROMPTS)]
        ids = tokenizer.encode(prompt)
        n = 5 + i % 13
        payload: dict[str, Any] = {
            "rid": f"c{i}",
            "stream": i % 2 == 0,
            "sampling_params": {"max_new_tokens": n},
        }
        payload["input_ids" if use_ids else "text"] = ids if use_ids else prompt
        cases.append((payload, ids, n))

    async def run() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30.0) as client:
            return await asyncio.gather(*(generate_merged(client, p) for p, _, _ in cases))

    results = asyncio.run(run())
    for (payload, ids, n), result in zip(cases, results, strict=True):
        expected = fake_output_ids(ids, n)
        assert result["output_ids"] == expected
        assert result["text"] == tokenizer.decode(expected, skip_special_tokens=True)
        meta = result["meta_info"]
        assert meta["id"] == payload["rid"]
        assert meta["finish_reason"] == {"type": "length"}
        assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (len(ids), n, 0)


def test_sse_bytes_are_exactly_the_documented_format(server: ServerProcess, tokenizer: Any) -> None:
    ids = tokenizer.encode("Hello world")
    payload = {"input_ids": ids, "stream": True, "rid": "sse1", "sampling_params": {"max_new_tokens": 3}}
    resp = httpx.post(server.url + "/generate", json=payload, timeout=10.0)
    out = fake_output_ids(ids, 3)
    expected = b""
    for k, token in enumerate(out):
        text = tokenizer.decode(out[: k + 1]).removeprefix(tokenizer.decode(out[:k]))
        meta = {
            "id": "sse1",
            "finish_reason": {"type": "length"} if k == 2 else None,
            "prompt_tokens": len(ids),
            "completion_tokens": k + 1,
            "cached_tokens": 0,
        }
        event = {"text": text, "output_ids": [token], "meta_info": meta}
        expected += (
            b"data: " + json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"
        )
    assert resp.content == expected + b"data: [DONE]\n\n"


def test_logprobs_streaming_and_not(server: ServerProcess, tokenizer: Any) -> None:
    ids = tokenizer.encode("capital of France")
    base = {
        "input_ids": ids,
        "return_logprob": True,
        "top_logprobs_num": 2,
        "sampling_params": {"max_new_tokens": 6},
    }

    async def run() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=10.0) as client:
            return list(
                await asyncio.gather(
                    generate_merged(client, base), generate_merged(client, {**base, "stream": True})
                )
            )

    for result in asyncio.run(run()):
        out = fake_output_ids(ids, 6)
        meta = result["meta_info"]
        assert meta["output_token_logprobs"] == [[pytest.approx(fake_logprob(t)), t] for t in out]
        assert [[row[1] for row in pos] for pos in meta["output_top_logprobs"]] == [[t, t + 1] for t in out]


def test_stop_strings_trim_and_abort_the_engine(server: ServerProcess, tokenizer: Any) -> None:
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    out = fake_output_ids(ids, 40)
    full = tokenizer.decode(out)
    boundary = len(tokenizer.decode(out[:6]))
    stop = full[boundary - 2 : boundary + 2]  # spans a token boundary
    later = full[boundary + 5 : boundary + 8]
    cut = min(full.find(stop), full.find(later))
    assert cut > 0
    for stream in (False, True):
        rid = f"stop{int(stream)}"
        payload = {
            "input_ids": ids,
            "rid": rid,
            "stream": stream,
            "sampling_params": {"max_new_tokens": 40, "stop": ["not-in-the-output", later, stop]},
        }
        result = asyncio.run(_with_client(server, payload))
        assert result["text"] == full[:cut]
        matched = stop if full.find(stop) == cut else later
        assert result["meta_info"]["finish_reason"] == {"type": "stop", "matched": matched}
        assert len(result["output_ids"]) < 40
        assert wait_engine_stat(server, f"abort_rid_{rid}") == 1.0


async def _with_client(server: ServerProcess, payload: dict[str, Any]) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=server.url, timeout=10.0) as client:
        return await generate_merged(client, payload)


def test_stop_token_and_eos(server: ServerProcess, tokenizer: Any) -> None:
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("Hello world") + [eos] + tokenizer.encode("abc")
    out = fake_output_ids(ids, 30)
    result = asyncio.run(_with_client(server, {"input_ids": ids, "sampling_params": {"max_new_tokens": 30}}))
    assert result["output_ids"] == out[: out.index(eos) + 1]
    assert result["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    assert "<|im_end|>" not in result["text"]
    params = {
        "max_new_tokens": 8,
        "ignore_eos": True,
        "stop_token_ids": [out[5]],
        "skip_special_tokens": False,
    }
    result = asyncio.run(_with_client(server, {"input_ids": ids, "sampling_params": params}))
    assert result["output_ids"] == out[: out.index(out[5]) + 1]
    assert "<|im_end|>" in result["text"]


def test_long_prompt_clips_max_new_tokens_to_the_context(server: ServerProcess) -> None:
    ids = [100] * (CONTEXT - 5)
    result = asyncio.run(_with_client(server, {"input_ids": ids, "sampling_params": {"max_new_tokens": 100}}))
    assert result["meta_info"]["completion_tokens"] == 5
    assert result["meta_info"]["finish_reason"] == {"type": "length"}


def test_client_disconnect_aborts_streaming_and_non_streaming(server: ServerProcess, tokenizer: Any) -> None:
    ids = tokenizer.encode("Hello world")
    payload = {
        "input_ids": ids,
        "rid": "gone_stream",
        "stream": True,
        "sampling_params": {"max_new_tokens": 1000},
    }
    with httpx.Client(timeout=10.0) as client:
        with client.stream("POST", server.url + "/generate", json=payload) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")
    assert wait_engine_stat(server, "abort_rid_gone_stream") == 1.0
    payload = {"input_ids": ids, "rid": "gone_plain", "sampling_params": {"max_new_tokens": 1000}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/generate", json=payload, timeout=0.3)
    assert wait_engine_stat(server, "abort_rid_gone_plain") == 1.0
    assert engine_stat(server, "frontend_in_flight_requests") == 0.0


def test_request_timeout_is_an_error_not_a_hang(server: ServerProcess, tokenizer: Any) -> None:
    ids = tokenizer.encode("Hello world")
    slow = {"max_new_tokens": 1000}

    async def run() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=10.0) as client:
            plain = client.post(
                "/generate", json={"input_ids": ids, "rid": "to_plain", "sampling_params": slow}
            )
            stream = client.post(
                "/generate",
                json={"input_ids": ids, "rid": "to_stream", "stream": True, "sampling_params": slow},
            )
            return await asyncio.gather(plain, stream)

    started = time.monotonic()
    plain, stream = asyncio.run(run())
    assert time.monotonic() - started < REQUEST_TIMEOUT_S + 3
    assert plain.status_code == 504 and plain.json()["error"]["type"] == "timeout"
    events = parse_sse(stream.content)
    assert events[-1]["error"]["type"] == "timeout" and events[-1]["error"]["code"] == 504
    assert wait_engine_stat(server, "abort_rid_to_plain") == 1.0
    assert wait_engine_stat(server, "abort_rid_to_stream") == 1.0


def test_engine_error_reaches_the_client(server: ServerProcess, tokenizer: Any) -> None:
    ids = tokenizer.encode("Hello world")
    resp = httpx.post(server.url + "/generate", json={"input_ids": ids, "rid": "fail-a"}, timeout=10.0)
    assert resp.status_code == 500
    assert resp.json()["error"]["message"] == "injected engine failure"
    resp = httpx.post(
        server.url + "/generate", json={"input_ids": ids, "rid": "fail-b", "stream": True}, timeout=10
    )
    events = parse_sse(resp.content)
    assert [len(e["output_ids"]) for e in events[:-1]] == [1, 1]
    assert events[-1] == {
        "error": {"message": "injected engine failure", "type": "internal_error", "code": 500}
    }


def test_duplicate_rid_and_abort_request(server: ServerProcess, tokenizer: Any) -> None:
    ids = tokenizer.encode("Hello world")
    payload = {"input_ids": ids, "rid": "dup", "stream": True, "sampling_params": {"max_new_tokens": 1000}}
    with httpx.Client(base_url=server.url, timeout=10.0) as client:
        with client.stream("POST", "/generate", json=payload) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")
            again = client.post("/generate", json={**payload, "stream": False})
            assert again.status_code == 400 and "already in flight" in again.json()["error"]["message"]
            assert client.post("/abort_request", json={"rid": "dup"}).json() == {
                "rid": "dup",
                "aborted": True,
            }
            events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "abort", "message": "aborted by request"}
    assert wait_engine_stat(server, "abort_rid_dup") == 1.0
    missing = httpx.post(server.url + "/abort_request", json={"rid": "nope"}, timeout=5.0)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404


BIG = b'{"text": "' + b"a" * (10 * 1024 * 1024) + b'"}'
BAD_INPUTS: list[tuple[str, bytes, str, int, str]] = [
    ("invalid json", b'{"text": "a",', "application/json", 400, "not valid JSON"),
    ("not an object", b"[1, 2]", "application/json", 400, "Expected `object`"),
    ("wrong type text", b'{"text": 5}', "application/json", 400, "Expected `str | null`, got `int`"),
    ("wrong type stream", b'{"text": "a", "stream": "yes"}', "application/json", 400, "$.stream"),
    ("float id", b'{"input_ids": [1.5]}', "application/json", 400, "$.input_ids[0]"),
    (
        "negative max_new_tokens",
        b'{"text": "a", "sampling_params": {"max_new_tokens": -1}}',
        "application/json",
        400,
        "max_new_tokens must be >= 0",
    ),
    (
        "huge max_new_tokens",
        b'{"text": "a", "sampling_params": {"max_new_tokens": 1000000000}}',
        "application/json",
        400,
        "exceeds the context length",
    ),
    (
        "prompt longer than context",
        json.dumps({"input_ids": [7] * 1100}).encode(),
        "application/json",
        400,
        "the model's context is 1024 tokens",
    ),
    (
        "unknown field",
        b'{"text": "a", "max_tokens": 3}',
        "application/json",
        400,
        "unknown field `max_tokens`",
    ),
    (
        "unknown sampling param",
        b'{"text": "a", "sampling_params": {"beam": 2}}',
        "application/json",
        400,
        "unknown sampling parameter(s): beam",
    ),
    (
        "bad temperature",
        b'{"text": "a", "sampling_params": {"temperature": -1}}',
        "application/json",
        400,
        "temperature",
    ),
    ("empty text", b'{"text": ""}', "application/json", 400, "the prompt is empty"),
    ("empty ids", b'{"input_ids": []}', "application/json", 400, "the prompt is empty"),
    ("both text and ids", b'{"text": "a", "input_ids": [1]}', "application/json", 400, "exactly one"),
    ("neither text nor ids", b'{"stream": false}', "application/json", 400, "exactly one"),
    ("id out of vocab", b'{"input_ids": [1, 1000000]}', "application/json", 400, "outside the vocabulary"),
    ("negative id", b'{"input_ids": [-1]}', "application/json", 400, "outside the vocabulary"),
    (
        "huge id",
        b'{"input_ids": [100000000000000000000000]}',
        "application/json",
        400,
        "outside the vocabulary",
    ),
    (
        "stop id out of vocab",
        b'{"text": "a", "sampling_params": {"stop_token_ids": [99999]}}',
        "application/json",
        400,
        "stop_token_ids",
    ),
    (
        "too many top logprobs",
        b'{"text": "a", "return_logprob": true, "top_logprobs_num": 50}',
        "application/json",
        400,
        "top_logprobs_num",
    ),
    ("partial bootstrap", b'{"text": "a", "bootstrap_room": 5}', "application/json", 400, "bootstrap"),
    ("invalid utf-8", b'{"text": "caf\xc3"}', "application/json", 400, "not valid UTF-8"),
    ("wrong content type", b'{"text": "a"}', "text/plain", 415, "Content-Type"),
    ("form content type", b"text=a", "application/x-www-form-urlencoded", 415, "Content-Type"),
    ("10 MB body", BIG, "application/json", 413, "larger than"),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_rejected_with_a_clear_error(server: ServerProcess, case: tuple[Any, ...]) -> None:
    _, body, ctype, status, message = case
    resp = httpx.post(server.url + "/generate", content=body, headers={"content-type": ctype}, timeout=30.0)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["code"] == status
    assert error["type"] == ("invalid_request_error" if status < 500 else error["type"])
    assert message in error["message"], error["message"]


def test_other_routes_and_server_keeps_serving(server: ServerProcess, tokenizer: Any) -> None:
    get = httpx.get(server.url + "/generate", timeout=5.0)
    assert get.status_code == 405 and get.json()["error"]["code"] == 405
    assert httpx.get(server.url + "/nope", timeout=5.0).json()["error"]["code"] == 404
    ids = tokenizer.encode("still alive")
    resp = httpx.post(
        server.url + "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}
    )
    assert resp.json()["output_ids"] == fake_output_ids(ids, 2)
    info = server.server_info()
    assert info["context_length"] == CONTEXT and info["disaggregation_mode"] == "null"
    assert info["max_total_tokens"] == 4096 and info["engine_alive"] is True


def test_metrics_cover_frontend_and_engine(server: ServerProcess) -> None:
    text = httpx.get(server.url + "/metrics", timeout=5.0).text
    assert 'pdserve_requests_total{status="200"}' in text
    assert 'pdserve_requests_total{status="400"}' in text
    assert "pdserve_time_to_first_token_seconds_count" in text
    assert "pdserve_inter_token_latency_seconds_count" in text
    assert "pdserve_e2e_request_latency_seconds_count" in text
    assert engine_stat(server, "engine_up") == 1.0
    assert engine_stat(server, "num_running_reqs") == 0.0
    assert (engine_stat(server, "requests_received") or 0) >= 32


def test_sigterm_stops_frontend_and_engine(server: ServerProcess) -> None:
    engine_pid = server.engine_pid()
    assert pid_alive(engine_pid)
    started = time.monotonic()
    assert server.stop() == 0
    grace_s = ServerArgs.__dataclass_fields__["graceful_shutdown_timeout"].default
    assert time.monotonic() - started < grace_s  # nothing in flight: the grace is not waited out
    assert wait_until(lambda: not pid_alive(engine_pid), 5.0, period_s=0.1), "engine outlived its frontend"
