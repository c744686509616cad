"""The official openai client, unchanged, through a real router process to PD stub workers."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from router.model_info import load_tokenizer
from tests.router.router_procs import ADMIN, RouterProc, StubWorker
from tests.router.stub_worker import token_at, token_text


@pytest.fixture(scope="module")
def pd(shared_pd: tuple[RouterProc, StubWorker, StubWorker]) -> tuple[RouterProc, StubWorker, StubWorker]:
    return shared_pd


@pytest.fixture(scope="module")
def client(pd: tuple[RouterProc, StubWorker, StubWorker]) -> openai.OpenAI:
    return openai.OpenAI(base_url=pd[0].url + "/v1", api_key="none", max_retries=0, timeout=20)


def expected(ids: list[int], n: int) -> str:
    return "".join(token_text(token_at(ids, i)) for i in range(n))


def test_models(client: openai.OpenAI, tiny_model: object) -> None:
    models = client.models.list().data  # the directory's name: no filesystem path goes to clients
    assert [m.id for m in models] == [Path(str(tiny_model)).name]
    assert str(tiny_model) not in httpx.get(str(client.base_url) + "models").text


def test_completion_non_streaming(client: openai.OpenAI, tiny_model: object,
                                  pd: tuple[RouterProc, StubWorker, StubWorker]) -> None:
    _, p, d = pd
    ids = load_tokenizer(str(tiny_model)).encode("Hello world")
    r = client.completions.create(model=str(tiny_model), prompt="Hello world", max_tokens=5, temperature=0)
    assert r.choices[0].text == expected(ids, 5)
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 5, len(ids) + 5)
    ps, ds = p.stats(), d.stats()
    # Both roles got identical token ids, the same room and the same request id.
    assert ps["inputs"][-1] == ds["inputs"][-1] == ids
    assert ps["rooms"][-1] == ds["rooms"][-1] and 0 <= ds["rooms"][-1] < 2**63
    assert ps["rids"][-1] == ds["rids"][-1] == ds["header_rids"][-1]
    assert r.id == "cmpl-" + ds["rids"][-1]
    assert d.stats()["last_body"]["sampling_params"]["temperature"] == 0.0


def test_completion_streaming_with_usage(client: openai.OpenAI, tiny_model: object) -> None:
    ids = [5, 6, 7]
    chunks = list(client.completions.create(model=str(tiny_model), prompt=ids, max_tokens=4, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected(ids, 4)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].usage.prompt_tokens == 3


def test_chat_non_streaming(client: openai.OpenAI, tiny_model: object) -> None:
    tok = load_tokenizer(str(tiny_model))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is KV?"}]
    ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)
    r = client.chat.completions.create(model=str(tiny_model), messages=messages,  # type: ignore[arg-type]
                                       max_completion_tokens=3)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected(ids, 3)
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 3


def test_chat_streaming_include_usage_and_stop(client: openai.OpenAI, tiny_model: object) -> None:
    tok = load_tokenizer(str(tiny_model))
    messages = [{"role": "user", "content": "Hi"}]
    ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)
    third = token_text(token_at(ids, 2))
    stream = client.chat.completions.create(model=str(tiny_model), messages=messages,  # type: ignore[arg-type]
                                            max_tokens=10, stream=True, stop=[third],
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == expected(ids, 2)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


def test_streaming_without_include_usage_has_no_usage(client: openai.OpenAI, tiny_model: object) -> None:
    chunks = list(client.completions.create(model=str(tiny_model), prompt="Hi", max_tokens=2, stream=True))
    assert all(c.usage is None for c in chunks) and all(c.choices for c in chunks)


def test_logprobs(client: openai.OpenAI, tiny_model: object) -> None:
    r = client.chat.completions.create(model=str(tiny_model), messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=3, logprobs=True, top_logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.content is not None and len(lp.content) == 3
    assert all(c.logprob == -0.5 and len(c.top_logprobs) == 2 for c in lp.content)
    c = client.completions.create(model=str(tiny_model), prompt="Hi", max_tokens=2, logprobs=1, stream=True)
    pieces = [ch.choices[0].logprobs for ch in c if ch.choices]
    assert sum(len(p.token_logprobs or []) for p in pieces if p) == 2


def test_request_id_header_round_trip(pd: tuple[RouterProc, StubWorker, StubWorker]) -> None:
    r, p, d = pd
    resp = httpx.post(r.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                      headers={"X-Request-Id": "my-req-42"})
    assert resp.status_code == 200 and resp.headers["x-request-id"] == "my-req-42"
    assert resp.json()["id"] == "cmpl-my-req-42"
    # workers see the router's own id: the client's is only a label (a reused one collides with nobody)
    assert p.stats()["rids"][-1] == d.stats()["rids"][-1] != "my-req-42"
    assert len(d.stats()["rids"][-1]) == 32
    resp = httpx.post(r.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert len(resp.headers["x-request-id"]) == 32


def test_generate_passthrough(pd: tuple[RouterProc, StubWorker, StubWorker]) -> None:
    r, _, d = pd
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3}, "rid": "native-1"}
    out = httpx.post(r.url + "/generate", json=body).json()
    assert out["output_ids"] == [token_at([1, 2, 3], i) for i in range(3)]
    assert out["meta_info"]["id"] == "native-1" and out["meta_info"]["finish_reason"]["type"] == "length"
    def stream(extra: dict[str, object]) -> list[str]:
        events = []
        with httpx.stream("POST", r.url + "/generate", json={**body, "stream": True, **extra}) as resp:
            assert resp.headers["content-type"].startswith("text/event-stream")
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        assert events[-1] == "[DONE]"
        return events[:-1]

    deltas = stream({"rid": "native-2", "incremental_stream": True})
    assert [json.loads(e)["output_ids"] for e in deltas] == [[token_at([1, 2, 3], i)] for i in range(3)]
    assert d.stats()["last_body"]["stream"] is True and d.stats()["last_body"]["incremental_stream"] is True
    cumulative = [json.loads(e) for e in stream({"rid": "native-3"})]  # SGLang's default: everything so far
    assert cumulative[-1]["output_ids"] == out["output_ids"] and cumulative[-1]["text"] == out["text"]
    assert all(a["output_ids"] == b["output_ids"][: len(a["output_ids"])] for a, b in zip(cumulative, cumulative[1:], strict=False))


def test_health_models_metrics(pd: tuple[RouterProc, StubWorker, StubWorker]) -> None:
    r = pd[0]
    assert httpx.get(r.url + "/health").json() == {"status": "ready"}
    text = httpx.get(r.url + "/metrics").text
    for name in ("router_requests_total", "router_ttft_seconds_bucket", "router_itl_seconds_bucket",
                 "router_e2e_seconds_bucket", "router_worker_inflight_requests", "router_worker_breaker_state"):
        assert name in text, name
    assert 'router_requests_total{route="/v1/completions",status="200"}' in text
    workers = httpx.get(r.url + "/workers", headers=ADMIN).json()
    assert workers["ready"] and {w["role"] for w in workers["workers"]} == {"prefill", "decode"}
    assert all(w["in_flight_requests"] == 0 and w["breaker"] == "closed" for w in workers["workers"])
