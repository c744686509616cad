"""Security review 2, the Low findings (../shared/reference/security_review_2.md), each replayed
against a real router over stub workers (L8 against the real tokenizer loader).

L1 /health and /metrics name no worker URL or worker text; no user:password@ worker URLs.
L12 a worker's 5xx text never reaches the client. L4 `priority` only with --enable-priority-scheduling.
L3 `cache_salt` is refused, not silently ignored. L11 no CDN-loaded /docs unless --enable-docs.
L8 tokenizer_config.json can name only a tokenizer class. L2 no open router on a public address.
L9 the router's prefix tree is bounded in nodes, not only tokens.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from common.tokenizer_loading import load_tokenizer
from router.prefix_tree import NODE_COST
from tests.pd.pd_procs import REPO_ROOT
from tests.router.router_procs import ADMIN, RouterProc, StubWorker, pd_args
from tests.security.front_procs import metric_value, wait_for
from tests.server.server_procs import free_port

COMP = {"prompt": "Hi", "max_tokens": 2}
FAST = ("--health-check-interval", "0.2", "--health-check-timeout", "0.5")
TREE_BOUND = 4096


@pytest.fixture(scope="module")
def stubs() -> Iterator[tuple[StubWorker, StubWorker]]:
    ws = [StubWorker("prefill", wait=False), StubWorker("decode", wait=False)]
    try:
        for w in ws:
            w.wait_up()
        yield ws[0], ws[1]
    finally:
        for w in ws:
            w.stop()


@pytest.fixture(scope="module")
def router(long_ctx_model: Path, stubs: tuple[StubWorker, StubWorker]) -> Iterator[RouterProc]:
    p, d = stubs
    r = RouterProc(long_ctx_model, pd_args([p], [d], *FAST, "--max-retries", "0", "--max-tree-tokens", str(TREE_BOUND)))
    try:
        r.wait_ready()
        yield r
    finally:
        r.stop()


@pytest.fixture(scope="module")
def opted(long_ctx_model: Path, stubs: tuple[StubWorker, StubWorker]) -> Iterator[RouterProc]:
    """One router with the two independent opt-ins (priority, docs) that L4 and L11 check."""
    p, d = stubs
    r = RouterProc(long_ctx_model, pd_args([p], [d], *FAST, "--enable-priority-scheduling", "--enable-docs"))
    try:
        r.wait_ready()
        yield r
    finally:
        r.stop()


def _leaks(text: str, *workers: StubWorker) -> list[str]:
    needles = ["127.0.0.1", "stub failure", *(str(w.port) for w in workers)]
    return [n for n in needles if n in text]


def test_l1_health_and_metrics_name_no_worker(long_ctx_model: Path) -> None:
    """A router whose pair probe fails: /health says which role is missing, nothing more."""
    p, d = StubWorker("prefill", fail_status=503), StubWorker("decode")
    r = RouterProc(long_ctx_model, pd_args([p], [d], *FAST))
    try:
        wait_for(lambda: httpx.get(r.url + "/workers", headers=ADMIN).json()["last_probe_error"], 20,
                 "a failed pair probe")
        detail = httpx.get(r.url + "/workers", headers=ADMIN).json()["last_probe_error"]
        assert "stub failure 503" in detail and p.url in detail  # the admin view keeps the details
        health = httpx.get(r.url + "/health")
        assert health.status_code == 503 and "round trip" in health.text
        assert _leaks(health.text, p, d) == [], health.text
        metrics = httpx.get(r.url + "/metrics").text
        assert 'router_worker_healthy{role="prefill",worker="prefill-0"}' in metrics, metrics
        assert _leaks(metrics, p, d) == [], [line for line in metrics.splitlines() if str(p.port) in line]
        p.stop()
        wait_for(lambda: httpx.get(r.url + "/health").json()["error"]["message"].endswith("prefill unavailable"),
                 20, "prefill marked down")
        assert _leaks(httpx.get(r.url + "/health").text, p, d) == []
        secret_url = f"http://admin:hunter2@127.0.0.1:{d.port + 7}"
        resp = httpx.post(r.url + "/workers", json={"url": secret_url, "role": "decode"}, headers=ADMIN)
        assert resp.status_code == 400 and "hunter2" not in resp.text, resp.text
        assert not any("hunter2" in u for u in r.workers())
    finally:
        r.stop()
        p.stop()
        d.stop()


def test_l12_worker_5xx_text_stays_in_the_log(router: RouterProc, stubs: tuple[StubWorker, StubWorker]) -> None:
    _, d = stubs
    for status in (503, 500):
        d.control(fail_status=status, fail_count=1)
        resp = httpx.post(router.url + "/v1/completions", json=COMP, timeout=30)
        assert resp.status_code == status, resp.text
        assert _leaks(resp.text, d) == [], resp.text
        assert f"stub failure {status}" in router.output()
    assert httpx.post(router.url + "/v1/completions", json=COMP, timeout=30).status_code == 200


def test_l4_priority_needs_the_operator(router: RouterProc, opted: RouterProc,
                                        stubs: tuple[StubWorker, StubWorker]) -> None:
    _, d = stubs
    before = d.stats()["generate"]
    resp = httpx.post(router.url + "/generate", json={"text": "Hi", "priority": 100}, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "priority", resp.text
    assert "--enable-priority-scheduling" in resp.text
    assert d.stats()["generate"] == before
    resp = httpx.post(opted.url + "/generate", json={"text": "Hi", "priority": 100}, timeout=30)
    assert resp.status_code == 200, resp.text
    assert (d.stats()["last_body"] or {}).get("priority") == 100


def test_l3_cache_salt_is_refused(router: RouterProc, stubs: tuple[StubWorker, StubWorker]) -> None:
    _, d = stubs
    before = d.stats()["generate"]
    for path, body in (("/generate", {"text": "Hi", "cache_salt": "tenant-a"}),
                       ("/v1/completions", {**COMP, "cache_salt": "tenant-a"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                 "cache_salt": "tenant-a"})):
        resp = httpx.post(router.url + path, json=body, timeout=30)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "cache_salt", (path, resp.text)
    assert d.stats()["generate"] == before


def test_l11_no_cdn_docs_by_default(router: RouterProc, opted: RouterProc) -> None:
    assert httpx.get(router.url + "/docs").status_code == 404
    assert "/generate" in httpx.get(router.url + "/openapi.json").json()["paths"]
    docs = httpx.get(opted.url + "/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()


def test_l8_tokenizer_config_names_only_tokenizers(long_ctx_model: Path, tmp_path: Path) -> None:
    """A checkpoint whose tokenizer_config.json names a non-tokenizer class (here AutoConfig, which
    has a from_pretrained) must not get that class instantiated as its tokenizer."""
    model = tmp_path / "evil"
    shutil.copytree(long_ctx_model, model)
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "AutoConfig"
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="'AutoConfig', which is not a transformers tokenizer"):
        load_tokenizer(str(model))


def test_l2_a_public_router_needs_a_client_key(long_ctx_model: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PDSERVE_API_KEY", "PDSERVE_CLUSTER_SECRET")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    argv = [sys.executable, "-m", "router", "--model-path", str(long_ctx_model), "--prefill", "http://127.0.0.1:1",
            "1", "--decode", "http://127.0.0.1:2", "--host", "0.0.0.0", "--port", str(free_port()), "--allow-unauthenticated"]
    out = subprocess.run(argv, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "--allow-unauthenticated-clients" in out.stderr, out
    opted = RouterProc(long_ctx_model, [*argv[5:10], "--host", "0.0.0.0", "--allow-unauthenticated",
                                        "--allow-unauthenticated-clients"])
    opted.stop()  # it served (wait_up passed): the flag lets an operator run it open on purpose


def test_l2_dns_rebinding_gets_no_answer(router: RouterProc, long_ctx_model: Path,
                                         stubs: tuple[StubWorker, StubWorker]) -> None:
    """A page rebound to 127.0.0.1 sends its own name as Host: a keyless loopback router refuses it."""
    evil = {"Host": f"attacker.example:{router.port}"}
    for method, path in (("GET", "/metrics"), ("GET", "/health"), ("POST", "/v1/completions")):
        resp = httpx.request(method, router.url + path, json=COMP if method == "POST" else None, headers=evil)
        assert resp.status_code == 421, (path, resp.text)
    for host in (f"localhost:{router.port}", f"127.0.0.1:{router.port}", "[::1]"):
        assert httpx.get(router.url + "/health", headers={"Host": host}).status_code == 200, host
    p, d = stubs
    named = RouterProc(long_ctx_model, pd_args([p], [d], "--allowed-hosts", "pd.internal"))
    try:
        assert httpx.get(named.url + "/metrics", headers={"Host": "pd.internal:80"}).status_code == 200
        assert httpx.get(named.url + "/metrics", headers={"Host": "attacker.example"}).status_code == 421
    finally:
        named.stop()


def test_l9_prefix_tree_is_bounded_in_nodes(router: RouterProc) -> None:
    """L9: prompts that leave a shared prefix at successive positions add ~2 nodes and ~2 tokens
    each; bounded only in tokens, 500 of them grew the tree to ~1,000 nodes (~600 B each) under
    a 4,096-token bound. Each node now counts NODE_COST tokens, and eviction keeps the bound."""
    base = [i % 50 + 1 for i in range(500)]
    with httpx.Client(base_url=router.url, timeout=30) as c:
        for k in range(1, 501):
            body = {"input_ids": [*base[:k], 99], "sampling_params": {"max_new_tokens": 1}}
            assert c.post("/generate", json=body).status_code == 200
    text = httpx.get(router.url + "/metrics", timeout=10).text
    nodes = metric_value(text, "router_prefix_tree_nodes", role="prefill")
    cost = metric_value(text, "router_prefix_tree_cost", role="prefill")
    assert 100 < nodes <= TREE_BOUND // NODE_COST and cost <= TREE_BOUND, (nodes, cost)
