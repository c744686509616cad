"""Malformed or out-of-range requests: 4xx with an OpenAI-shaped body, nothing reaches a worker."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.router.router_procs import RouterProc, StubWorker

CTX = 1024  # build_tiny_checkpoint's max_position_embeddings
C, CHAT, GEN = "/v1/completions", "/v1/chat/completions", "/generate"
OK_MSG = [{"role": "user", "content": "hi"}]


def comp(**kw: Any) -> dict[str, Any]:
    return {"prompt": "hi", "max_tokens": 2, **kw}


def chat(**kw: Any) -> dict[str, Any]:
    return {"messages": OK_MSG, "max_tokens": 2, **kw}


def without(d: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k != key}


# (id, path, body: dict | bytes, headers, expected status)
CASES: list[tuple[str, str, Any, dict[str, str] | None, int]] = [
    ("broken-json", C, b'{"prompt": "hi"', None, 400),
    ("empty-body", C, b"", None, 400),
    ("json-array", C, b"[1, 2]", None, 400),
    ("json-string", C, b'"hi"', None, 400),
    ("invalid-utf8", C, b'{"prompt": "\xff\xfe"}', None, 400),
    ("lone-surrogate", C, b'{"prompt": "\\ud800"}', None, 400),
    ("nan-literal", C, b'{"prompt": "hi", "temperature": NaN}', None, 400),
    ("n-2", C, comp(n=2), None, 400),
    ("n-string", C, comp(n="1"), None, 400),
    ("max-tokens-minus-one", C, comp(max_tokens=-1), None, 400),
    ("max-tokens-huge", C, comp(max_tokens=10**9), None, 400),
    ("max-tokens-bigint", C, comp(max_tokens=10**30), None, 400),
    ("max-tokens-string", C, comp(max_tokens="10"), None, 400),
    ("max-tokens-float", C, comp(max_tokens=1.5), None, 400),
    ("max-tokens-bool", C, comp(max_tokens=True), None, 400),
    ("temperature-negative", C, comp(temperature=-1), None, 400),
    ("temperature-string", C, comp(temperature="hot"), None, 400),
    ("temperature-huge", C, comp(temperature=1e9), None, 400),
    ("top-p-zero", C, comp(top_p=0), None, 400),
    ("top-p-above-one", C, comp(top_p=1.5), None, 400),
    ("top-k-zero", C, comp(top_k=0), None, 400),
    ("min-p-two", C, comp(min_p=2), None, 400),
    ("repetition-penalty-zero", C, comp(repetition_penalty=0), None, 400),
    ("frequency-penalty-3", C, comp(frequency_penalty=3), None, 400),
    ("presence-penalty-minus-3", C, comp(presence_penalty=-3), None, 400),
    ("seed-string", C, comp(seed="abc"), None, 400),
    ("seed-too-big", C, comp(seed=2**70), None, 400),
    ("stop-int", C, comp(stop=123), None, 400),
    ("stop-empty-string", C, comp(stop=[""]), None, 400),
    ("stop-too-many", C, comp(stop=[f"s{i}" for i in range(17)]), None, 400),
    ("stop-token-ids-out-of-vocab", C, comp(stop_token_ids=[99999]), None, 400),
    ("ignore-eos-string", C, comp(ignore_eos="no"), None, 400),
    ("prompt-missing", C, without(comp(), "prompt"), None, 400),
    ("prompt-int", C, comp(prompt=123), None, 400),
    ("prompt-empty-list", C, comp(prompt=[]), None, 400),
    ("prompt-empty-string", C, comp(prompt=""), None, 400),
    ("prompt-mixed-list", C, comp(prompt=[1, "a"]), None, 400),
    ("prompt-batch-ids", C, comp(prompt=[[1, 2], [3]]), None, 400),
    ("prompt-batch-str", C, comp(prompt=["a", "b"]), None, 400),
    ("prompt-negative-id", C, comp(prompt=[-1]), None, 400),
    ("prompt-id-out-of-vocab", C, comp(prompt=[10**6]), None, 400),
    ("prompt-over-context-text", C, comp(prompt="hello world " * 1500), None, 400),
    ("prompt-ids-at-context", C, comp(prompt=[5] * CTX), None, 400),
    ("prompt-plus-max-tokens-over-context", C, comp(prompt=[5] * 1000, max_tokens=100), None, 400),
    ("unknown-model", C, comp(model="gpt-9"), None, 404),
    ("stream-string", C, comp(stream="yes"), None, 400),
    ("stream-options-int", C, comp(stream=True, stream_options=5), None, 400),
    ("logprobs-too-many", C, comp(logprobs=50), None, 400),
    ("echo-not-bool", C, comp(echo="yes"), None, 400),
    ("chat-role-object", CHAT, {"messages": [{"role": {}, "content": "hi"}]}, None, 400),  # was a 500
    ("gen-lora", GEN, {"text": "hi", "lora_path": "adapter"}, None, 400),
    ("gen-image", GEN, {"text": "hi", "image_data": "http://x/y.png"}, None, 400),
    ("gen-stop-regex", GEN, {"text": "hi", "sampling_params": {"stop_regex": "a+"}}, None, 400),
    ("gen-two-grammars", GEN, {"text": "hi", "sampling_params": {"regex": "a+", "ebnf": "root ::= \"a\""}}, None, 400),
    ("gen-logprob-start-past-prompt", GEN, {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2},
     None, 400),
    ("best-of-3", C, comp(best_of=3), None, 400),
    ("logit-bias", C, comp(logit_bias={"1": 5}), None, 400),
    ("suffix", C, comp(suffix="end"), None, 400),
    ("content-type-text", C, json.dumps(comp()).encode(), {"content-type": "text/plain"}, 415),
    ("content-type-form", C, b"prompt=hi", {"content-type": "application/x-www-form-urlencoded"}, 415),
    ("body-10mb", C, json.dumps(comp(prompt="a" * (10 << 20))).encode(), None, 413),
    ("chat-messages-missing", CHAT, without(chat(), "messages"), None, 400),
    ("chat-messages-empty", CHAT, chat(messages=[]), None, 400),
    ("chat-messages-string", CHAT, chat(messages="hi"), None, 400),
    ("chat-message-not-object", CHAT, chat(messages=["hi"]), None, 400),
    ("chat-unknown-role", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), None, 400),
    ("chat-role-missing", CHAT, chat(messages=[{"content": "hi"}]), None, 400),
    ("chat-content-missing", CHAT, chat(messages=[{"role": "user"}]), None, 400),
    ("chat-content-int", CHAT, chat(messages=[{"role": "user", "content": 5}]), None, 400),
    ("chat-image-part", CHAT,
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), None, 400),
    ("chat-tools", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), None, 400),
    ("chat-top-logprobs-without-logprobs", CHAT, chat(top_logprobs=5), None, 400),
    ("chat-logprobs-string", CHAT, chat(logprobs="yes"), None, 400),
    ("chat-max-completion-tokens-negative", CHAT, chat(max_completion_tokens=-3), None, 400),
    ("chat-response-format-no-schema", CHAT, chat(response_format={"type": "json_schema"}), None, 400),
    ("chat-response-format-kind", CHAT, chat(response_format={"type": "structural_tag"}), None, 400),
    ("chat-n-3", CHAT, chat(n=3), None, 400),
    ("chat-over-context", CHAT, chat(messages=[{"role": "user", "content": "hello world " * 1500}]), None, 400),
    ("gen-text-and-ids", GEN, {"text": "hi", "input_ids": [1]}, None, 400),
    ("gen-neither", GEN, {"sampling_params": {}}, None, 400),
    ("gen-sampling-params-string", GEN, {"text": "hi", "sampling_params": "x"}, None, 400),
    ("gen-unknown-sampling-param", GEN, {"text": "hi", "sampling_params": {"bogus": 1}}, None, 400),
    ("gen-max-new-tokens-negative", GEN, {"text": "hi", "sampling_params": {"max_new_tokens": -1}}, None, 400),
    ("gen-client-bootstrap-room", GEN, {"text": "hi", "bootstrap_room": 5}, None, 400),
    ("gen-float-ids", GEN, {"input_ids": [1.5]}, None, 400),
    ("gen-rid-too-long", GEN, {"text": "hi", "rid": "x" * 500}, None, 400),
    ("gen-top-logprobs-100", GEN, {"text": "hi", "return_logprob": True, "top_logprobs_num": 100}, None, 400),
    ("gen-unknown-field", GEN, {"text": "hi", "foo": 1}, None, 400),
]


def _send(url: str, path: str, body: Any, headers: dict[str, str] | None) -> httpx.Response:
    if isinstance(body, bytes):
        h = {"content-type": "application/json", **(headers or {})}
        return httpx.post(url + path, content=body, headers=h, timeout=30)
    return httpx.post(url + path, json=body, headers=headers, timeout=30)


def test_case_count() -> None:
    assert len(CASES) >= 50 and len({c[0] for c in CASES}) == len(CASES)


def test_bad_inputs_rejected_before_any_worker(shared_pd: tuple[RouterProc, StubWorker, StubWorker]) -> None:
    r, p, d = shared_pd
    before = (p.stats()["generate"], d.stats()["generate"])
    failures = []
    for name, path, body, headers, status in CASES:
        resp = _send(r.url, path, body, headers)
        try:
            err = resp.json()["error"]
            ok = (resp.status_code == status and isinstance(err["message"], str) and err["message"]
                  and err["type"] and "param" in err and "code" in err)
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            failures.append(f"{name}: {resp.status_code} {resp.text[:200]}")
    assert not failures, "\n".join(failures)
    assert (p.stats()["generate"], d.stats()["generate"]) == before, "a bad request reached a worker"
    # Still healthy and serving.
    assert httpx.get(r.url + "/health").status_code == 200
    ok = httpx.post(r.url + C, json=comp(), timeout=30)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(("method", "path", "status"), [("GET", C, 405), ("POST", "/v2/nothing", 404)])
def test_unknown_routes_are_openai_shaped(shared_pd: tuple[RouterProc, StubWorker, StubWorker], method: str,
                                          path: str, status: int) -> None:
    resp = httpx.request(method, shared_pd[0].url + path)
    assert resp.status_code == status and resp.json()["error"]["code"] == status


def test_param_named_in_error(shared_pd: tuple[RouterProc, StubWorker, StubWorker]) -> None:
    resp = httpx.post(shared_pd[0].url + C, json=comp(max_tokens=-1))
    assert resp.json()["error"]["param"] == "max_tokens"
    assert resp.json()["error"]["type"] == "invalid_request_error"
