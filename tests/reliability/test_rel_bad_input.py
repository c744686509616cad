"""Malformed requests at the router (native + OpenAI routes) and directly at each role's
/generate: every one gets a 4xx with a clear message, no process crashes, nothing leaks.
Also: a duplicate bootstrap room sent directly to the roles is refused clearly."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from tests.reliability.client import Batch, Job, pd_body, run_jobs
from tests.reliability.cluster import HOLD_FILE, Cluster
from tests.reliability.scenario import assert_correct, check_router_serves, hold, prompts

CTX = 1024  # build_tiny_checkpoint's context length
TEN_MB = 10 * 1024 * 1024
Body = dict[str, Any] | bytes
Case = tuple[str, Body, dict[str, str] | None]
GOOD_IDS = [5, 6, 7, 8]


def _sp(**kw: Any) -> dict[str, Any]:
    return {"max_new_tokens": 4, **kw}


def transport_cases(good: dict[str, Any]) -> list[Case]:
    """Broken bodies that no route may accept."""
    big_json = json.dumps({**good, "text": "a" * TEN_MB}).encode()
    return [
        ("broken-json", b'{"input_ids": [1, 2', None),
        ("trailing-comma", b'{"input_ids": [1, 2],}', None),
        ("not-json", b"hello", None),
        ("empty-body", b"", None),
        ("json-array", b"[1, 2]", None),
        ("json-null", b"null", None),
        ("json-number", b"123", None),
        ("nul-bytes", b"\x00\x01\x02", None),
        ("invalid-utf8", b'{"text": "\xff\xfe"}', None),
        ("invalid-utf8-key", b'{"\xc3\x28": 1}', None),
        ("lone-surrogate", b'{"text": "\\ud800"}', None),
        ("nan", b'{"input_ids": [1], "sampling_params": {"temperature": NaN}}', None),
        ("ctype-text-plain", json.dumps(good).encode(), {"Content-Type": "text/plain"}),
        ("ctype-form", b"input_ids=1", {"Content-Type": "application/x-www-form-urlencoded"}),
        ("ctype-multipart", b"--x\r\n\r\n--x--", {"Content-Type": "multipart/form-data; boundary=x"}),
        ("10mb-json", big_json, None),
        ("10mb-garbage", b"x" * TEN_MB, None),
    ]


def native_cases(good: dict[str, Any]) -> list[Case]:
    """The native /generate body with one thing wrong."""
    def with_(**kw: Any) -> dict[str, Any]:
        return {**good, **kw}

    cases: list[tuple[str, dict[str, Any]]] = [
        ("ids-string", with_(input_ids="abc")),
        ("ids-float", with_(input_ids=[1.5])),
        ("ids-nested", with_(input_ids=[[1, 2]])),
        ("ids-object", with_(input_ids={"a": 1})),
        ("ids-negative", with_(input_ids=[-1])),
        ("ids-out-of-vocab", with_(input_ids=[10**6])),
        ("ids-u64", with_(input_ids=[2**64])),
        ("ids-empty", with_(input_ids=[])),
        ("text-and-ids", with_(text="hi")),
        ("no-prompt", {k: v for k, v in good.items() if k != "input_ids"}),
        ("text-int", {**{k: v for k, v in good.items() if k != "input_ids"}, "text": 123}),
        ("text-empty", {**{k: v for k, v in good.items() if k != "input_ids"}, "text": ""}),
        ("ids-at-context", with_(input_ids=[5] * CTX)),
        ("ids-over-context", with_(input_ids=[5] * 5000)),
        ("text-over-context", {**{k: v for k, v in good.items() if k != "input_ids"}, "text": "hello " * 3000}),
        ("sp-list", with_(sampling_params=[1])),
        ("sp-string", with_(sampling_params="greedy")),
        ("sp-unknown-key", with_(sampling_params=_sp(bogus=1))),
        ("sp-openai-name", with_(sampling_params={"max_tokens": 4})),
        ("max-new-negative", with_(sampling_params=_sp(max_new_tokens=-1))),
        ("max-new-huge", with_(sampling_params=_sp(max_new_tokens=10**30))),
        ("max-new-over-context", with_(sampling_params=_sp(max_new_tokens=CTX + 1))),
        ("max-new-word", with_(sampling_params=_sp(max_new_tokens="four"))),
        ("max-new-float", with_(sampling_params=_sp(max_new_tokens=2.5))),
        ("temperature-negative", with_(sampling_params=_sp(temperature=-1))),
        ("temperature-string", with_(sampling_params=_sp(temperature="hot"))),
        ("top-p-zero", with_(sampling_params=_sp(top_p=0))),
        ("top-p-two", with_(sampling_params=_sp(top_p=2))),
        ("top-k-zero", with_(sampling_params=_sp(top_k=0))),
        ("min-p-two", with_(sampling_params=_sp(min_p=2))),
        ("rep-penalty-zero", with_(sampling_params=_sp(repetition_penalty=0))),
        ("freq-penalty-five", with_(sampling_params=_sp(frequency_penalty=5))),
        ("seed-huge", with_(sampling_params=_sp(seed=2**70))),
        ("stop-int", with_(sampling_params=_sp(stop=123))),
        ("stop-ids-strings", with_(sampling_params=_sp(stop_token_ids=["a"]))),
        ("stream-string", with_(stream="yes")),
        ("logprob-int", with_(return_logprob=2)),
        ("top-logprobs-21", with_(return_logprob=True, top_logprobs_num=21)),
        ("top-logprobs-negative", with_(top_logprobs_num=-1)),
        ("rid-int", with_(rid=123)),
        ("rid-too-long", with_(rid="r" * 5000)),
        ("unknown-field", with_(foo=1)),
    ]
    return [(name, body, None) for name, body in cases]


def role_cases(good: dict[str, Any]) -> list[Case]:
    """Bootstrap fields, which only the roles accept."""
    def with_(**kw: Any) -> dict[str, Any]:
        return {**good, **kw}

    no_boot = {k: v for k, v in good.items() if not k.startswith("bootstrap")}
    cases: list[tuple[str, dict[str, Any]]] = [
        ("no-bootstrap", no_boot),
        ("partial-bootstrap", {**no_boot, "bootstrap_room": 1}),
        ("room-negative", with_(bootstrap_room=-1)),
        ("room-2^63", with_(bootstrap_room=2**63)),
        ("room-2^64", with_(bootstrap_room=2**64)),
        ("room-string", with_(bootstrap_room="1")),
        ("port-zero", with_(bootstrap_port=0)),
        ("port-70000", with_(bootstrap_port=70000)),
        ("port-string", with_(bootstrap_port="x")),
        ("host-empty", with_(bootstrap_host="")),
        ("host-space", with_(bootstrap_host="not a host")),
        ("host-star", with_(bootstrap_host="*")),
        ("host-dash", with_(bootstrap_host="-h")),
        ("host-unicode", with_(bootstrap_host="é.com")),
        ("host-url", with_(bootstrap_host="tcp://127.0.0.1")),
        ("host-int", with_(bootstrap_host=1)),
    ]
    return [(name, body, None) for name, body in cases]


def openai_cases() -> list[tuple[str, str, Body]]:
    comp: Callable[..., dict[str, Any]] = lambda **kw: {"prompt": GOOD_IDS, "max_tokens": 4, **kw}  # noqa: E731
    chat: Callable[..., dict[str, Any]] = lambda **kw: {  # noqa: E731
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}
    c, ch = "/v1/completions", "/v1/chat/completions"
    return [
        ("c-no-prompt", c, {"max_tokens": 4}),
        ("c-prompt-int", c, comp(prompt=123)),
        ("c-prompt-batch", c, comp(prompt=[[1], [2]])),
        ("c-prompt-over-context", c, comp(prompt=[5] * 2000)),
        ("c-max-tokens-negative", c, comp(max_tokens=-5)),
        ("c-max-tokens-huge", c, comp(max_tokens=10**12)),
        ("c-n-2", c, comp(n=2)),
        ("c-temperature-string", c, comp(temperature="hot")),
        ("c-logprobs-50", c, comp(logprobs=50)),
        ("c-unknown-model", c, comp(model="gpt-9")),
        ("c-stream-string", c, comp(stream="yes")),
        ("c-broken-json", c, b'{"prompt": '),
        ("c-10mb", c, json.dumps(comp(prompt="a" * TEN_MB)).encode()),
        ("ch-no-messages", ch, {"max_tokens": 4}),
        ("ch-messages-string", ch, chat(messages="hi")),
        ("ch-messages-empty", ch, chat(messages=[])),
        ("ch-bad-role", ch, chat(messages=[{"role": "wizard", "content": "hi"}])),
        ("ch-content-int", ch, chat(messages=[{"role": "user", "content": 5}])),
        ("ch-image-part", ch, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])),
        ("ch-top-p-zero", ch, chat(top_p=0)),
        ("ch-invalid-utf8", ch, b'{"messages": [{"role": "user", "content": "\xff"}]}'),
        ("ch-response-format", ch, chat(response_format={"type": "json_schema"})),
    ]


def _post(client: httpx.Client, url: str, body: Body, headers: dict[str, str] | None) -> httpx.Response:
    if isinstance(body, bytes):
        return client.post(url, content=body, headers=headers or {"Content-Type": "application/json"})
    return client.post(url, content=json.dumps(body).encode(), headers=headers or {"Content-Type": "application/json"})


def _check_4xx(r: httpx.Response, what: str) -> None:
    assert 400 <= r.status_code < 500, f"{what}: got {r.status_code} {r.text[:300]}"
    err = r.json()["error"]
    assert isinstance(err["message"], str) and len(err["message"]) > 5, f"{what}: unclear error {err}"


def test_bad_input_is_refused_everywhere(whole_cluster: Cluster, tiny_llama_path: str) -> None:
    c = whole_cluster
    native = {"input_ids": GOOD_IDS, "sampling_params": _sp()}
    role_good = pd_body(c.p_fast, GOOD_IDS, 4, stream=False)
    targets: list[tuple[str, str, list[Case]]] = [
        ("router", c.router.url, transport_cases(native) + native_cases(native)),
        *((inst.name, inst.url, transport_cases(role_good) + native_cases(role_good) + role_cases(role_good))
          for inst in (c.p_fast, c.d_big)),
    ]
    sent = 0
    with httpx.Client(timeout=60.0) as client:
        for name, url, cases in targets:
            for case_id, body, headers in cases:
                _check_4xx(_post(client, url + "/generate", body, headers), f"{name} {case_id}")
                sent += 1
        for case_id, path, body in openai_cases():
            _check_4xx(_post(client, c.router.url + path, body, None), f"router {case_id}")
            sent += 1
    assert sent >= 100
    for inst in c.instances:
        assert inst.healthy(), f"{inst.name} went down: {inst.log()}"
    assert c.router.workers()[c.p_fast.url]["total_failures"] == 0
    check_router_serves(c, tiny_llama_path, 2)
    c.wait_whole()


def test_decode_with_unreachable_prefill_fails_in_bound(whole_cluster: Cluster) -> None:
    """Well-formed bootstrap fields naming no prefill: an error by the handshake timeout
    (10 s, kv_transfer's default), never a hang; decode keeps serving."""
    c = whole_cluster

    def post(host: str) -> httpx.Response:
        body = {**pd_body(c.p_fast, GOOD_IDS, 4, stream=False), "bootstrap_host": host, "bootstrap_port": 1}
        return httpx.post(c.d_big.url + "/generate", json=body, timeout=60.0)

    t0 = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(post, ["127.0.0.1", "no-such-host.invalid"]))
    assert time.monotonic() - t0 < 10.0 + 5.0
    for r in answers:
        assert r.status_code == 500 and "handshake" in r.json()["error"]["message"], r.text
    assert c.d_big.healthy()
    assert all(o.ok for o in run_jobs([Job(c.p_fast, c.d_big, p, 4) for p in prompts(2, 10, 41)]))
    c.wait_whole()


def test_duplicate_room_is_refused(whole_cluster: Cluster, tiny_llama_path: str) -> None:
    """A second request with a live room, sent straight to the roles: refused with a clear
    duplicate-room error on both sides; the first request is untouched."""
    c = whole_cluster
    room = 12345678901
    (first_prompt,) = prompts(1, 400, seed=51)
    HOLD_FILE.touch()  # the first request's transfer stays in flight (its room live) until both claims are answered
    try:
        first = Batch([Job(c.p_slow, c.d_big, first_prompt, 8, room=room)])
        hold(c.p_slow, lambda s: s["num_inflight_queue_reqs"] >= 1, "the first request transferring")
        dup = run_jobs([Job(c.p_slow, c.d_big, prompts(1, 20, seed=52)[0], 4, cancel_prefill=False, room=room)])[0]
        # a third decode claims the same room at the prefill (another decode's TransferRequest)
        other = httpx.post(c.d_small.url + "/generate", json=pd_body(c.p_slow, GOOD_IDS, 4, stream=False, room=room),
                           timeout=60.0)
    finally:
        HOLD_FILE.unlink(missing_ok=True)
    assert_correct(tiny_llama_path, first.wait())
    for side, text in (("prefill", dup.prefill.error), ("decode", dup.decode.error), ("other decode", other.text)):
        assert text is not None and "duplicate" in text.lower() and str(room) in text, f"{side}: {text}"
    assert other.status_code >= 400
    for inst in c.instances:
        assert inst.healthy()
    c.wait_whole()
