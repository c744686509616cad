"""Failure handling with real processes: dead workers, failing prefill, broken streams, disconnects."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import httpx
import openai
import pytest

from tests.harness.process import wait_until
from tests.router.router_procs import ADMIN, Cluster, RouterProc, pd_args

COMP = {"prompt": [5, 6, 7], "max_tokens": 3}


def post(r: RouterProc, body: dict[str, Any], path: str = "/v1/completions", timeout: float = 30) -> httpx.Response:
    return httpx.post(r.url + path, json=body, timeout=timeout)


def sse_events(r: RouterProc, body: dict[str, Any], path: str = "/v1/completions") -> tuple[int, list[str]]:
    with httpx.stream("POST", r.url + path, json={**body, "stream": True}, timeout=30) as resp:
        if resp.status_code != 200:
            resp.read()
            return resp.status_code, [resp.text]
        return 200, [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]


def metric(r: RouterProc, name: str) -> float:
    text = httpx.get(r.url + "/metrics").text
    return sum(float(m) for m in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def wait_for(cond: Any, timeout: float, what: str) -> float:
    """Seconds until `cond` held; AssertionError past `timeout`."""
    t0 = time.monotonic()
    assert wait_until(cond, timeout), f"timed out after {timeout}s waiting for {what}"
    return time.monotonic() - t0


def test_worker_death_retry_all_down_and_runtime_add(cluster: Cluster) -> None:
    p, d1, d2, d3 = cluster.stubs("prefill", "decode", "decode", "decode")  # d3 joins later
    interval, threshold, timeout = 1.0, 2, 0.5
    r = cluster.router(pd_args([p], [d1, d2], "--decode-policy", "round_robin", "--health-check-interval",
                               str(interval), "--health-failure-threshold", str(threshold),
                               "--health-check-timeout", str(timeout)))
    r.wait_ready()
    d1.reset()  # the readiness probe went through d1
    assert all(post(r, COMP).status_code == 200 for _ in range(4))
    assert d1.stats()["generate"] == 2 and d2.stats()["generate"] == 2

    # Kill d1: nothing was sent to the client yet, so every request is retried onto d2.
    d1.kill()
    t_kill = time.monotonic()
    for _ in range(4):
        resp = post(r, COMP)
        assert resp.status_code == 200, resp.text
    assert metric(r, "router_retries_total") >= 1
    bound = interval * threshold + timeout + interval  # checks are aligned to the interval
    wait_for(lambda: not r.workers()[d1.url]["healthy"], bound + 1.0, "d1 marked down")
    assert time.monotonic() - t_kill <= bound + 1.0

    # All decode workers down -> 503 with a clear OpenAI-shaped body, health 503.
    d2.kill()
    wait_for(lambda: not r.workers()[d2.url]["healthy"], bound + 1.0, "d2 marked down")
    resp = post(r, COMP)
    assert resp.status_code == 503
    err = resp.json()["error"]
    assert "no healthy decode worker" in err["message"] and err["type"] == "service_unavailable"
    assert httpx.get(r.url + "/health").status_code == 503
    client = openai.OpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.InternalServerError, match="no healthy decode worker"):
        client.completions.create(model=str(cluster.model), prompt="hi", max_tokens=1)

    # A worker added at runtime takes traffic and makes the router ready again.
    added = httpx.post(r.url + "/workers", json={"url": d3.url, "role": "decode"}, headers=ADMIN).json()
    assert added["healthy"] is True
    assert httpx.post(r.url + "/workers", json={"url": d3.url, "role": "decode"}, headers=ADMIN).status_code == 409
    sources = {w["url"]: w["source"] for w in httpx.get(r.url + "/workers", headers=ADMIN).json()["workers"]}
    assert sources.pop(d3.url) == "api" and set(sources.values()) == {"command-line"}  # how each was found
    assert d3.stats()["generate"] == 1  # the bootstrap round trip re-verified the pair
    d3.reset()
    assert all(post(r, COMP).status_code == 200 for _ in range(3))
    assert d3.stats()["generate"] == 3
    wait_for(lambda: httpx.get(r.url + "/health").status_code == 200, 5, "ready again")
    # Removing it: no decode left again.
    assert httpx.delete(r.url + "/workers", params={"url": d3.url}, headers=ADMIN).status_code == 200
    assert post(r, COMP).status_code == 503
    assert d3.stats()["generate"] == 3


# Once the router is ready it probes with GET /health only (no more round trips through
# /generate), so the one injected failure of the last step goes to the client's request.
def test_prefill_failure_before_first_token_is_an_error(cluster: Cluster) -> None:
    p, d = cluster.stubs("prefill", "decode")
    p.control(fail_status=500)
    decode_delay_s = 5.0
    d.control(delay_s=decode_delay_s)
    r = cluster.router(pd_args([p], [d], "--health-check-interval", "0.2", "--max-retries", "1",
                               "--breaker-failure-threshold", "100"))
    # Not ready: the bootstrap round trip through the pair fails.
    wait_for(lambda: "round trip" in httpx.get(r.url + "/health").text, 10, "probe failure reported")
    assert httpx.get(r.url + "/health").status_code == 503
    p.reset()
    d.reset()

    t0 = time.monotonic()
    resp = post(r, COMP)
    # a worker's 5xx text (and address) goes to the router's log, not to the client
    assert resp.status_code == 500 and resp.json()["error"]["message"] == "a worker failed to serve the request " \
        "(internal_error)"
    assert "stub failure 500" in r.output()
    assert time.monotonic() - t0 < decode_delay_s  # did not wait for decode's first token
    status, body = sse_events(r, COMP)
    assert status == 500 and "a worker failed" in body[0]  # streaming too: an HTTP error, not an empty 200
    rids = [rid for rid in p.stats()["rids"] if not rid.startswith("health-")]
    assert len(rids) == 4 and len(rids) == len(set(rids))  # 2 requests x 2 attempts
    # Decode got those it received before prefill failed (some are cancelled before sending) closed on it.
    reached = [rid for rid in d.stats()["rids"] if rid in rids]
    assert reached
    wait_for(lambda: set(reached) <= set(d.stats()["aborted_rids"]), 5, "decode connections closed")
    rooms = [b for rid, b in zip(p.stats()["rids"], p.stats()["rooms"], strict=True) if rid in rids]
    assert len(set(rooms)) == 4  # a new room per attempt

    # Non-retryable prefill error: returned at once, one attempt.
    p.control(fail_status=400)
    n = p.stats()["generate"]
    assert post(r, COMP).status_code == 400
    assert [rid for rid in p.stats()["rids"][n:] if not rid.startswith("health-")][0].count(".r") == 0

    # Once prefill recovers, the bootstrap round trip succeeds and the router becomes ready.
    p.control(fail_status=None)
    d.control(delay_s=0.0)
    wait_for(lambda: httpx.get(r.url + "/health").status_code == 200, 5, "ready after prefill recovers")
    # A transient prefill failure is retried with a new pair and room, and succeeds.
    p.reset()
    d.reset()
    # Decode answers only after prefill's verdict, as a real decode (it waits for the KV) does;
    # an instant stub decode would race the 503 and win with its own 200.
    d.control(delay_s=1.0)
    p.control(fail_status=503, fail_count=1)
    resp = post(r, COMP)
    assert resp.status_code == 200, resp.text
    ps = p.stats()
    assert ps["generate"] == 2 and ps["rooms"][0] != ps["rooms"][1]
    assert d.stats()["rooms"][-1] == ps["rooms"][1]


def test_decode_failures(cluster: Cluster) -> None:
    p, d_bad, d_ok = cluster.stubs("prefill", "decode", "decode")
    d_bad.control(error_after_tokens=2)
    r = cluster.router(pd_args([p], [d_bad], "--health-check-interval", "0.2", "--max-migrations", "0"))
    r.wait_ready()
    # Mid-stream failure after tokens reached the client: an in-band error event, then [DONE].
    status, events = sse_events(r, {"prompt": [1, 2], "max_tokens": 5})
    assert status == 200
    assert len(events) == 4 and events[-1] == "[DONE]"
    assert json.loads(events[2])["error"]["type"] == "kv_transfer_failed"
    assert "stub in-band failure" in r.output()
    # Non-streaming: nothing was sent yet, so the failure is retried on another decode worker.
    httpx.post(r.url + "/workers", json={"url": d_ok.url, "role": "decode"}, headers=ADMIN).raise_for_status()
    d_bad.control(die_after_tokens=1, error_after_tokens=None)
    codes = [post(r, {"prompt": [1, 2], "max_tokens": 3, "stream": False}).status_code for _ in range(4)]
    assert codes == [200] * 4
    # A streamed request that loses its decode worker after a token gets an error event, not a silent cut.
    d_ok.control(die_after_tokens=1)
    d_bad.kill()
    wait_for(lambda: not r.workers()[d_bad.url]["healthy"], 5, "dead worker down")
    status, events = sse_events(r, {"prompt": [1, 2], "max_tokens": 5})
    assert status == 200 and "error" in json.loads(events[-2]) and events[-1] == "[DONE]"


def test_client_disconnect_aborts_both_and_timeout(cluster: Cluster) -> None:
    p, d = cluster.stubs("prefill", "decode")
    d.control(token_delay_s=0.2)
    r = cluster.router(pd_args([p], [d], "--health-check-interval", "0.2", "--request-timeout", "20"))
    r.wait_ready()
    p.control(delay_s=30.0)
    p.reset()
    d.reset()
    with httpx.stream("POST", r.url + "/v1/completions", json={**COMP, "max_tokens": 100, "stream": True},
                      timeout=30) as resp:
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(3)]
        assert any(line.startswith("data: ") for line in got)
    wait_for(lambda: d.stats()["aborted"] == 1 and p.stats()["aborted"] == 1, 5, "both workers aborted")
    wait_for(lambda: all(w["in_flight_requests"] == 0 for w in r.workers().values()), 5, "load released")

    # Non-streaming: the client leaving mid-request aborts both too.
    d.control(delay_s=5.0)
    with pytest.raises(httpx.ReadTimeout):
        post(r, {**COMP, "max_tokens": 100}, timeout=0.5)
    wait_for(lambda: d.stats()["aborted"] == 2 and p.stats()["aborted"] == 2, 5, "both aborted (non-stream)")


def test_request_timeout_and_breaker(cluster: Cluster) -> None:
    p, d1, d2 = cluster.stubs("prefill", "decode", "decode")
    r = cluster.router(pd_args([p], [d1, d2], "--health-check-interval", "0.2", "--request-timeout", "1.0",
                               "--decode-policy", "round_robin", "--breaker-failure-threshold", "2",
                               "--breaker-open-seconds", "60", "--max-retries", "2"))
    r.wait_ready()
    d1.reset()
    # 429 is retried elsewhere; two failures open d1's breaker, then it gets no traffic.
    d1.control(fail_status=429)
    assert [post(r, COMP).status_code for _ in range(6)] == [200] * 6
    assert r.workers()[d1.url]["breaker"] == "open"
    n = d1.stats()["generate"]
    assert n == 2
    assert all(post(r, COMP).status_code == 200 for _ in range(3)) and d1.stats()["generate"] == n
    # Per-request timeout: 504, OpenAI-shaped, well before the slow worker would answer.
    slow_s = 10.0
    d2.control(delay_s=slow_s)
    t0 = time.monotonic()
    resp = post(r, COMP)
    assert resp.status_code == 504 and resp.json()["error"]["type"] == "timeout"
    assert time.monotonic() - t0 < slow_s  # the 1 s request timeout answered, not the worker
    wait_for(lambda: d2.stats()["aborted"] >= 1, 5, "timed-out request aborted on the worker")


def test_colocated_mode(cluster: Cluster) -> None:
    w1, w2 = cluster.stubs("colocated", "colocated")
    r = cluster.router(["--worker", w1.url, "--worker", w2.url, "--policy", "round_robin",
                        "--health-check-interval", "0.2"])
    r.wait_ready()
    client = openai.OpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
    for _ in range(2):
        out = client.completions.create(model=str(cluster.model), prompt=[3, 4], max_tokens=2)
        assert out.choices[0].finish_reason == "length" and out.usage and out.usage.completion_tokens == 2
    chunks = list(client.chat.completions.create(model=str(cluster.model), max_tokens=2, stream=True,
                                                 messages=[{"role": "user", "content": "hi"}]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks)
    # The stubs refuse bootstrap fields in colocated mode, so 200s prove none were sent.
    assert w1.stats()["generate"] + w2.stats()["generate"] == 3 and w1.stats()["generate"] >= 1
    assert "bootstrap_room" not in (w1.stats()["last_body"] or {})


def test_prefill_499_defers_to_decode(cluster: Cluster) -> None:
    """P's 499 means decode gave the transfer up: D's answer is the request's, and P is not blamed."""
    p, d = cluster.stubs("prefill", "decode")
    r = cluster.router(pd_args([p], [d], "--max-retries", "0", "--breaker-failure-threshold", "100"))
    r.wait_ready()
    p.control(fail_status=499)
    d.control(fail_status=503, delay_s=0.3)
    resp = post(r, COMP)
    assert resp.status_code == 503 and "temporarily unavailable" in resp.json()["error"]["message"], resp.text
    d.control(fail_status=None, delay_s=0.3)
    resp = post(r, COMP)
    assert resp.status_code == 200, resp.text
    failures = {u: w["total_failures"] for u, w in r.workers().items()}
    assert failures == {p.url: 0, d.url: 1}
