"""Issue 23, cheap rejects first: what a bad or hostile request costs the router and an instance.

Against a real router (stub workers behind it, and a colocated router in front of a real
instance on the fake engine) and real instances: a 7 MB prompt is refused while /health
keeps answering, 100k-deep JSON is a 400 without a traceback, caps hold before any worker
is reached, a reused client request id hurts nobody, client errors carry no worker
address, and an instance past --max-queued-requests answers 503 + Retry-After at once.

Security review 2: M6, the router's cheap checks come before its expensive ones (a 4M-id prompt is
measured before its ids are checked one by one; a chat's message count and rendered prompt are
bounded before tokenizing); M1, prompt logprobs past --max-prompt-logprob-entries are a 400 that
no worker sees.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.admission import Admission
from router.config import RouterConfig
from router.errors import ApiError
from router.metrics import RouterMetrics
from router.registry import WorkerRegistry
from tests.router.router_procs import RouterProc, StubWorker, pd_args
from tests.security.front_procs import metric, wait_for
from tests.server.server_procs import ServerProcess

HEALTH_BOUND_S = 0.5  # the bound for /health while a huge prompt is rejected
HUGE_PROMPT = "word " * 1_450_000  # 7.25 MB of text
MAX_PROMPT_CHARS = 100_000
MAX_LOGPROB_ENTRIES = 2000


@pytest.fixture(scope="module")
def pd(long_ctx_model: Path) -> Iterator[tuple[RouterProc, StubWorker, StubWorker]]:
    p, d = StubWorker("prefill", wait=False), StubWorker("decode", wait=False)
    # test_client_errors_name_no_worker_address injects decode failures: with the default threshold
    # they opened decode's breaker for 10 s and failed whichever test came next (not under test here)
    r = RouterProc(long_ctx_model, pd_args([p], [d], "--health-check-interval", "0.2", "--breaker-failure-threshold", "1000",
                                           "--max-prompt-chars",
                                           str(MAX_PROMPT_CHARS), "--max-chat-messages", "64",
                                           "--max-prompt-logprob-entries", str(MAX_LOGPROB_ENTRIES)), wait=False)
    try:
        for w in (p, d):
            w.wait_up()
        r.wait_up()
        r.wait_ready()
        yield r, p, d
    finally:
        for proc in (r, p, d):
            proc.stop()


@pytest.fixture(scope="module")
def inst(long_ctx_model: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(long_ctx_model)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def colocated(long_ctx_model: Path, inst: ServerProcess) -> Iterator[RouterProc]:
    r = RouterProc(long_ctx_model, ["--worker", inst.url, "--health-check-interval", "0.2"])
    try:
        r.wait_ready()
        yield r
    finally:
        r.stop()


def _target(which: str, pd: tuple[RouterProc, StubWorker, StubWorker], inst: ServerProcess
            ) -> tuple[str, str, dict[str, Any]]:
    """(base url, generation path, body with the huge prompt)."""
    if which == "router":
        return pd[0].url, "/v1/completions", {"prompt": HUGE_PROMPT, "max_tokens": 1}
    return inst.url, "/generate", {"text": HUGE_PROMPT, "sampling_params": {"max_new_tokens": 1}}


def _post_in_thread(url: str, body: bytes) -> Future[httpx.Response]:
    fut: Future[httpx.Response] = Future()

    def run() -> None:
        try:
            fut.set_result(httpx.post(url, content=body, headers={"Content-Type": "application/json"}, timeout=60))
        except BaseException as e:
            fut.set_exception(e)

    threading.Thread(target=run, daemon=True).start()
    return fut


@pytest.mark.parametrize("which", ["router", "instance"])
def test_huge_prompt_is_refused_while_health_answers(which: str, pd: tuple[RouterProc, StubWorker, StubWorker],
                                                     inst: ServerProcess) -> None:
    base, path, body = _target(which, pd, inst)
    raw = json.dumps(body).encode()
    assert len(raw) > 7_000_000
    fut = _post_in_thread(base + path, raw)
    latencies = []
    with httpx.Client(timeout=10) as client:
        while True:  # at least one probe, then until the huge request has its answer
            t0 = time.monotonic()
            assert client.get(base + "/health").status_code == 200
            latencies.append(time.monotonic() - t0)
            if fut.done():
                break
    resp = fut.result()
    assert resp.status_code == 400 and "characters" in resp.json()["error"]["message"]
    assert max(latencies) < HEALTH_BOUND_S, latencies


@pytest.mark.parametrize("which", ["router", "instance"])
def test_deeply_nested_json_is_a_400_without_a_traceback(which: str, pd: tuple[RouterProc, StubWorker, StubWorker],
                                                         inst: ServerProcess) -> None:
    base, path, _ = _target(which, pd, inst)
    key = b'"prompt"' if which == "router" else b'"custom_labels"'  # an untyped field: decoded as a whole
    raw = b"{" + key + b": " + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for _ in range(3):
        resp = httpx.post(base + path, content=raw, headers={"Content-Type": "application/json"}, timeout=30)
        assert resp.status_code == 400, resp.text
        assert "nested too deeply" in resp.json()["error"]["message"]
    log = pd[0].output() if which == "router" else inst.log()
    assert "Traceback" not in log and "RecursionError" not in log


def test_caps_hold_before_any_worker(pd: tuple[RouterProc, StubWorker, StubWorker], inst: ServerProcess) -> None:
    r, p, d = pd
    before = p.stats()["generate"], d.stats()["generate"]
    long_stop = "x" * 300
    cases = [
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "stop": [long_stop]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "stop": long_stop}),
        ("/generate", {"text": "Hi", "sampling_params": {"stop": [long_stop]}}),
        ("/generate", {"text": "Hi", "priority": 2**40}),
        ("/generate", {"text": "Hi", "priority": -(2**40)}),
        ("/generate", {"text": "Hi", "sampling_params": {"stop_token_ids": list(range(5, 3000))}}),
    ]
    for path, body in cases:
        resp = httpx.post(r.url + path, json=body)
        assert resp.status_code == 400, (path, body.keys(), resp.text)
    assert (p.stats()["generate"], d.stats()["generate"]) == before
    resp = httpx.post(inst.url + "/generate", json={"text": "Hi", "sampling_params": {"stop": [long_stop]}})
    assert resp.status_code == 400 and "256 characters" in resp.json()["error"]["message"]


def test_a_reused_client_request_id_is_only_a_label(colocated: RouterProc) -> None:
    """Two users sending the same id at once both get their answer (the instance refuses a
    duplicate rid in flight, so the router must not forward the client's id)."""
    body = {"input_ids": [5, 6, 7], "rid": "dup", "stream": True,
            "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
    headers = {"X-Request-Id": "dup"}
    with httpx.Client(timeout=30) as client, client.stream("POST", colocated.url + "/generate", json=body,
                                                           headers=headers) as first:
        assert first.status_code == 200
        lines = first.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # the first request is in flight
        second = client.post(colocated.url + "/generate", json={**body, "stream": False}, headers=headers)
        assert second.status_code == 200, second.text
        assert second.json()["meta_info"]["id"] == "dup" and second.headers["x-request-id"] == "dup"
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:])["meta_info"]["id"] == "dup"


def test_client_errors_name_no_worker_address(pd: tuple[RouterProc, StubWorker, StubWorker]) -> None:
    r, _, d = pd
    addresses = ("127.0.0.1", str(d.port), "localhost")
    d.control(fail_status=500, fail_count=-1)
    try:
        resp = httpx.post(r.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=30)
    finally:
        d.control(fail_status=None)
    assert resp.status_code == 500
    assert not any(a in resp.text for a in addresses), resp.text
    assert "stub failure" not in resp.text  # a worker's 5xx text stays in the router's log
    d.control(error_after_tokens=1)
    try:
        with httpx.stream("POST", r.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "stream": True},
                          timeout=30) as s:
            events = [line for line in s.iter_lines() if line.startswith("data: ")]
    finally:
        d.control(error_after_tokens=None)
    err = json.loads(events[-2][6:])["error"]
    assert err["type"] == "kv_transfer_failed" and not any(a in err["message"] for a in addresses), err
    assert d.url in r.output()  # the details are in the router's log


@pytest.fixture(scope="module")
def small(long_ctx_model: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(long_ctx_model, "--max-running-requests", "1", "--max-queued-requests", "1")
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def test_instance_refuses_past_max_queued_requests(small: ServerProcess) -> None:
    long = {"input_ids": [5, 6, 7], "stream": True, "sampling_params": {"max_new_tokens": 20000, "ignore_eos": True}}
    in_flight = "pdserve_frontend_in_flight_requests"
    with httpx.Client(timeout=30) as client:
        streams = [client.stream("POST", small.url + "/generate", json=long) for _ in range(2)]
        readers = []  # kept: a dropped line iterator closes its connection
        try:
            for s in streams:  # running + queued: both admitted and streaming
                resp = s.__enter__()
                assert resp.status_code == 200
                readers.append(resp.iter_lines())
                assert next(line for line in readers[-1] if line.startswith("data: "))
            assert metric(small.url, in_flight) == 2
            for _ in range(3):
                refused = client.post(small.url + "/generate", json={**long, "stream": False})
                assert refused.status_code == 503, refused.text
                assert int(refused.headers["retry-after"]) >= 1
            assert metric(small.url, "pdserve_rejected_full_total") == 3
        finally:
            for s in streams:
                s.__exit__(None, None, None)
        wait_for(lambda: metric(small.url, in_flight) == 0, 10, "the closed streams released")
        ok = client.post(small.url + "/generate", json={"input_ids": [5, 6, 7],
                                                        "sampling_params": {"max_new_tokens": 2}})
        assert ok.status_code == 200, ok.text


def _refused(r: RouterProc, workers: tuple[StubWorker, ...], path: str, body: Any, needle: str) -> None:
    """400 naming `needle`, and no worker saw the request."""
    before = [w.stats()["generate"] for w in workers]
    raw = body if isinstance(body, bytes) else json.dumps(body, separators=(",", ":")).encode()
    resp = httpx.post(r.url + path, content=raw, headers={"Content-Type": "application/json"}, timeout=60)
    assert resp.status_code == 400, resp.text[:500]
    assert needle in resp.json()["error"]["message"], resp.json()["error"]
    assert [w.stats()["generate"] for w in workers] == before


def test_m6_cheap_checks_come_first(pd: tuple[RouterProc, StubWorker, StubWorker]) -> None:
    """4M input ids ending in an out-of-vocabulary id: the length is the answer (no pass over the
    elements first); many empty chat messages: their count; messages whose text fits
    --max-prompt-chars but whose rendered prompt does not: the rendered length."""
    r, p, d = pd
    ids = b"[" + b"1," * 4_000_000 + b"1000000000]"
    _refused(r, (p, d), "/generate", b'{"input_ids": ' + ids + b"}", "maximum context length")
    _refused(r, (p, d), "/v1/completions", b'{"max_tokens": 1, "prompt": ' + ids + b"}", "maximum context length")
    empty = [{"role": "user", "content": ""}] * 250_000  # 7.3 MB
    _refused(r, (p, d), "/v1/chat/completions", {"messages": empty, "max_tokens": 1}, "--max-chat-messages")
    n = 64
    text = "a" * (MAX_PROMPT_CHARS // n - 10)  # the contents alone fit; with each message's markup they do not
    _refused(r, (p, d), "/v1/chat/completions", {"messages": [{"role": "user", "content": text}] * n,
                                                 "max_tokens": 1}, "characters")
    ok = httpx.post(r.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}] * n,
                                                          "max_tokens": 1}, timeout=30)
    assert ok.status_code == 200, ok.text


def test_m1_prompt_logprobs_are_bounded(pd: tuple[RouterProc, StubWorker, StubWorker], inst: ServerProcess) -> None:
    """echo + logprobs on /v1/completions, logprob_start_len + top_logprobs_num on /generate: past
    --max-prompt-logprob-entries ((prompt - start) x max(1, top)) a 400 that no worker sees; an
    instance holds its own bound (default 100,000) for clients that reach it directly."""
    r, p, d = pd
    ids = list(range(5, 5 + 200))  # 200 prompt tokens x 20 = 4,000 entries > 2,000
    _refused(r, (p, d), "/v1/completions", {"prompt": ids, "echo": True, "logprobs": 20, "max_tokens": 1},
             "--max-prompt-logprob-entries")
    gen = {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 20,
           "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 1}}
    _refused(r, (p, d), "/generate", gen, "--max-prompt-logprob-entries")
    # Within the bound: the tail of the prompt (100 x 20), or the whole prompt with no alternatives.
    for body in ({**gen, "logprob_start_len": 100}, {**gen, "top_logprobs_num": 0}):
        assert httpx.post(r.url + "/generate", json=body, timeout=30).status_code == 200
    ok = {"prompt": ids[:100], "echo": True, "logprobs": 20, "max_tokens": 1}
    assert httpx.post(r.url + "/v1/completions", json=ok, timeout=30).status_code == 200
    direct = {**gen, "input_ids": [5] * 6000}  # 6,000 x 20 = 120,000 entries
    resp = httpx.post(inst.url + "/generate", json=direct, timeout=30)
    assert resp.status_code == 400 and "--max-prompt-logprob-entries" in resp.text, resp.text
    assert httpx.post(inst.url + "/generate", json={**direct, "logprob_start_len": 1000}, timeout=30).status_code == 200


def test_m6_the_parse_backlog_counts_against_the_queue() -> None:
    """Bodies waiting for the parse pool hold queue places: past --max-queued-requests the next
    request is a 503 before its body is read, not one more in an unbounded parse queue."""
    cfg = RouterConfig.from_args(["--model-path", "/m", "--worker", "http://w:1", "--max-queued-requests", "2"])
    registry = WorkerRegistry(cfg)
    admission = Admission(cfg, registry, RouterMetrics(registry))
    with admission.parsing(), admission.parsing():
        with pytest.raises(ApiError) as e:
            admission.check_full()
        assert e.value.status == 503 and e.value.retry_after == 1
        with pytest.raises(ApiError), admission.parsing():
            pass
    assert admission.parsing_now == 0
    admission.check_full()
