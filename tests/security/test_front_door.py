"""Issue 23, front door: who may call the router, and with what.

Replays the attacks of the report against a real router over stub workers: a client
without the key, a hijack through POST/DELETE /workers, /workers as a port scanner,
and a cross-site (non-JSON) POST. Each must fail, and the service must keep serving.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from common.server.conn_limits import RATE_WINDOW_S
from tests.router.router_procs import ADMIN, RouterProc, StubWorker, pd_args
from tests.security.front_procs import PartialBody
from tests.server.server_procs import free_port

KEY = "sk-client-key-1"
ENV_KEY = "sk-client-key-from-env"
COMP = {"prompt": "Hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def stubs() -> Iterator[tuple[StubWorker, StubWorker, StubWorker]]:
    """Prefill, decode, and a third decode stub playing the attacker's fake decode."""
    ws = [StubWorker("prefill", wait=False), StubWorker("decode", wait=False), StubWorker("decode", wait=False)]
    try:
        for w in ws:
            w.wait_up()
        yield ws[0], ws[1], ws[2]
    finally:
        for w in ws:
            w.stop()


@pytest.fixture(scope="module")
def routers(long_ctx_model: Path, stubs: tuple[StubWorker, StubWorker, StubWorker]
            ) -> Iterator[tuple[RouterProc, RouterProc]]:
    """(keyed router with worker admin on, router keyed by PDSERVE_API_KEY with worker admin off)."""
    p, d, _ = stubs
    args = pd_args([p], [d], "--health-check-interval", "0.2", "--health-check-timeout", "0.5")
    keyed = RouterProc(long_ctx_model, [*args, "--api-key", KEY], wait=False)
    no_admin = RouterProc(long_ctx_model, args, wait=False, admin_key=None, env={"PDSERVE_API_KEY": ENV_KEY})
    try:
        for r in (keyed, no_admin):
            r.wait_up()
            r.wait_ready()
        yield keyed, no_admin
    finally:
        keyed.stop()
        no_admin.stop()


def _client(r: RouterProc, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=r.url + "/v1", api_key=key, max_retries=0, timeout=30)


def test_openai_client_needs_the_api_key(routers: tuple[RouterProc, RouterProc],
                                         stubs: tuple[StubWorker, StubWorker, StubWorker]) -> None:
    r, _ = routers
    d = stubs[1]
    model = _client(r, KEY).models.list().data[0].id
    out = _client(r, KEY).completions.create(model=model, prompt="Hi", max_tokens=2)
    assert out.choices[0].text
    before = d.stats()["generate"]
    with pytest.raises(openai.AuthenticationError) as err:
        _client(r, "sk-wrong").completions.create(model=model, prompt="Hi", max_tokens=2)
    assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    for path, body in (("/v1/completions", COMP), ("/v1/chat/completions", {"messages": []}),
                       ("/generate", {"text": "Hi"})):
        resp = httpx.post(r.url + path, json=body)
        assert resp.status_code == 401, path
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
        assert resp.headers["www-authenticate"] == "Bearer"
    assert httpx.get(r.url + "/v1/models").status_code == 401
    assert httpx.post(r.url + "/v1/completions", json=COMP, headers={"Authorization": "Basic " + KEY}).status_code == 401
    assert d.stats()["generate"] == before  # nothing unauthenticated reached a worker
    # Load balancers and Prometheus need no key.
    assert httpx.get(r.url + "/health").status_code == 200
    assert httpx.get(r.url + "/metrics").status_code == 200


def test_api_key_from_the_environment(routers: tuple[RouterProc, RouterProc]) -> None:
    _, r = routers
    client = _client(r, ENV_KEY)
    model = client.models.list().data[0].id
    assert client.completions.create(model=model, prompt="Hi", max_tokens=1).choices[0].text
    with pytest.raises(openai.AuthenticationError):
        _client(r, KEY).completions.create(model=model, prompt="Hi", max_tokens=1)


def test_worker_hijack_is_refused(routers: tuple[RouterProc, RouterProc],
                                  stubs: tuple[StubWorker, StubWorker, StubWorker]) -> None:
    r, _ = routers
    _, d, fake = stubs
    fake_body = {"url": fake.url, "role": "decode"}
    for headers in ({}, {"Authorization": f"Bearer {KEY}"}):  # no key, or the clients' key
        assert httpx.post(r.url + "/workers", json=fake_body, headers=headers).status_code == 401
        assert httpx.delete(r.url + "/workers", params={"url": d.url}, headers=headers).status_code == 401
        assert httpx.get(r.url + "/workers", headers=headers).status_code == 401
    assert set(r.workers()) == {stubs[0].url, d.url}
    before_real, before_fake = d.stats()["generate"], fake.stats()["generate"]
    resp = httpx.post(r.url + "/v1/completions", json=COMP, headers={"Authorization": f"Bearer {KEY}"})
    assert resp.status_code == 200
    assert d.stats()["generate"] == before_real + 1 and fake.stats()["generate"] == before_fake


def test_worker_admin_is_off_without_an_admin_key(routers: tuple[RouterProc, RouterProc],
                                                  stubs: tuple[StubWorker, StubWorker, StubWorker]) -> None:
    _, r = routers
    fake = stubs[2]
    for method, kwargs in (("GET", {}), ("POST", {"json": {"url": fake.url, "role": "decode"}}),
                           ("DELETE", {"params": {"url": stubs[1].url}})):
        resp = httpx.request(method, r.url + "/workers", headers={"Authorization": f"Bearer {ENV_KEY}"}, **kwargs)
        assert resp.status_code == 403, method
        assert "--admin-api-key" in resp.json()["error"]["message"]
    assert fake.stats()["generate"] == 0


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and closes them at once: open, but not a pdserve worker."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
                conn.close()
            except TimeoutError:
                pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1]
    finally:
        stop.set()
        t.join(5)
        srv.close()


def test_post_workers_does_not_tell_open_from_closed_ports(routers: tuple[RouterProc, RouterProc],
                                                            silent_port: int) -> None:
    r, _ = routers
    answers: dict[str, Any] = {}
    for kind, port in (("closed", free_port()), ("open", silent_port)):
        url = f"http://127.0.0.1:{port}"
        resp = httpx.post(r.url + "/workers", json={"url": url, "role": "decode"}, headers=ADMIN, timeout=30)
        assert resp.status_code == 200, resp.text
        body = resp.json()
        answers[kind] = {k: v for k, v in body.items() if k != "url"}
        assert httpx.delete(r.url + "/workers", params={"url": url}, headers=ADMIN).status_code == 200
    assert answers["closed"] == answers["open"]
    assert answers["open"]["healthy"] is False


def test_bodies_must_be_json(routers: tuple[RouterProc, RouterProc],
                             stubs: tuple[StubWorker, StubWorker, StubWorker]) -> None:
    r, _ = routers
    d = stubs[1]
    before = d.stats()["generate"]
    auth = {"Authorization": f"Bearer {KEY}"}
    raw = b'{"prompt": "Hi", "max_tokens": 1}'
    for ctype in (None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        headers = dict(auth, **({"Content-Type": ctype} if ctype else {}))
        resp = httpx.post(r.url + "/v1/completions", content=raw, headers=headers)
        assert resp.status_code == 415, (ctype, resp.text)
        admin = dict(ADMIN, **({"Content-Type": ctype} if ctype else {}))
        body = b'{"url": "http://127.0.0.1:1", "role": "decode"}'
        assert httpx.post(r.url + "/workers", content=body, headers=admin).status_code == 415
    assert d.stats()["generate"] == before
    assert httpx.post(r.url + "/v1/completions", content=raw,
                      headers=dict(auth, **{"Content-Type": "application/json; charset=utf-8"})).status_code == 200


def test_m2_a_refused_client_cannot_keep_sending(routers: tuple[RouterProc, RouterProc]) -> None:
    """Security review 2, M2: a 401 is answered before the body is read; the connection then closes
    instead of swallowing a body trickled for ever."""
    r, _ = routers
    c = PartialBody(r.port, "/v1/completions", 1 << 20)
    try:
        took = c.trickle_until_closed(b"x" * 3000, 0.2, RATE_WINDOW_S)
        assert c.answer.startswith(b"HTTP/1.1 401") and b"connection: close" in c.answer.lower(), c.answer[:300]
        assert took < RATE_WINDOW_S
    finally:
        c.close()
