"""Issue 23, items 2, 3 and 6, replayed against real processes: a prefill and a decode instance
holding one cluster secret (a 0600 file) and the router holding only keys derived from it.
Workers refuse every call without a fresh MAC but /health and /metrics, a real decode tells a
fake prefill nothing, nothing of ours listens beyond --host, and a non-loopback bind without a
secret is refused. Security review 2: M4 (an on-path tap between router and prefill captures
requests that cannot be replayed; /health probes carry no credential; no https:// downgrade)
and L6 (a weak secret is refused; the router's key file cannot act as a decode)."""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import zmq

from common.cluster_secret import (
    ENV_VAR,
    ClusterSecret,
    ClusterSecretError,
    CurveKeys,
    RouterKeys,
    require_safe_bind,
)
from common.request_mac import SCHEME
from common.zmq_curve import CurveSecurity
from kv_transfer.messages import InfoQuery, encode
from tests.pd.pd_procs import REPO_ROOT, PDPair, start_pair
from tests.router.router_procs import RouterProc
from tests.security.byte_capture import ByteCapture
from tests.security.wiretap import WireTap, send_raw

HANDSHAKE_S = 3.0


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("secret") / "cluster_secret"
    path.write_text(secrets.token_hex(32))
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def pair(tiny_llama_path: str, secret_file: Path) -> Iterator[PDPair]:
    flags = ["--cluster-secret-file", str(secret_file), "--disaggregation-handshake-timeout", str(HANDSHAKE_S),
             "--max-total-tokens", "16384"]  # not the default 1 GiB pool: a few short requests use it
    pd = start_pair(Path(tiny_llama_path), flags, flags)
    try:
        yield pd
    finally:
        pd.stop()


@pytest.fixture(scope="module")
def router_keys_file(secret_file: Path) -> Path:
    """What pd.sh and the chart give the router: derived keys, made by the real CLI."""
    out = subprocess.run([sys.executable, "-m", "common.cluster_secret", "router-keys", "--cluster-secret-file",
                          str(secret_file)], cwd=REPO_ROOT, capture_output=True, check=True, timeout=60)
    path = secret_file.with_name("router_keys")
    path.write_bytes(out.stdout)
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def tap(pair: PDPair) -> Iterator[WireTap]:
    t = WireTap(pair.prefill.port)
    yield t
    t.stop()


@pytest.fixture(scope="module")
def router(pair: PDPair, tiny_llama_path: str, router_keys_file: Path, tap: WireTap) -> Iterator[RouterProc]:
    proc = RouterProc(tiny_llama_path, ["--prefill", tap.url, str(pair.prefill.bootstrap_port),
                                        "--decode", pair.decode.url, "--cluster-secret-file", str(router_keys_file)],
                      wait=False)
    try:
        proc.wait_ready(timeout=120)
        yield proc
    finally:
        proc.stop()


def signed(secret_file: Path, method: str, path: str, body: bytes = b"") -> dict[str, str]:
    """Headers of a request made by a holder of the cluster's HTTP key (the router's signer)."""
    secret = ClusterSecret.load(str(secret_file))
    assert secret is not None
    return {"Authorization": secret.router_keys().signer().sign(method, path, body), "Content-Type": "application/json"}


def served(router: RouterProc) -> None:
    r = httpx.post(router.url + "/generate", timeout=60,
                   json={"input_ids": [5, 6, 7, 8, 9], "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 4, r.text


def test_workers_answer_only_the_router(pair: PDPair, router: RouterProc, secret_file: Path) -> None:
    """Item 2: /generate and /abort_request were open to anyone who reached a worker."""
    served(router)
    for role in (pair.prefill, pair.decode):
        body = pair.body([1, 2, 3], 2, stream=False)
        for headers, status in (({}, 401), ({"Authorization": "Bearer " + "0" * 64}, 403),
                                ({"Authorization": f"{SCHEME} ts={int(time.time())},nonce={'0' * 32},sig={'0' * 64}"},
                                 403)):
            r = httpx.post(role.url + "/generate", json=body, headers=headers, timeout=10)
            assert r.status_code == status and r.json()["error"]["code"] == status, r.text
            assert httpx.post(role.url + "/abort_request", json={"rid": "any"}, headers=headers,
                              timeout=10).status_code == status
            for path in ("/server_info", "/health_generate"):
                assert httpx.get(role.url + path, headers=headers, timeout=10).status_code == status
        assert httpx.post(role.url + "/generate", json=body, timeout=10).headers["www-authenticate"].startswith(SCHEME)
        assert httpx.get(role.url + "/health", timeout=10).status_code == 200
        assert httpx.get(role.url + "/metrics", timeout=10).status_code == 200
        headers = signed(secret_file, "GET", "/server_info")
        assert httpx.get(role.url + "/server_info", headers=headers, timeout=10).status_code == 200
    pair.wait_whole()
    served(router)


def test_decode_tells_a_fake_prefill_nothing(pair: PDPair, router: RouterProc, secret_file: Path) -> None:
    """Item 3: a request naming a fake prefill as bootstrap_host got decode's NIXL metadata and
    KV base addresses. Now decode's CURVE handshake fails against it: not a byte of Register
    leaves, the request fails with an error, and the service keeps serving."""
    listener = ByteCapture(accept_timeout_s=HANDSHAKE_S + 10, window_s=HANDSHAKE_S + 1)
    fake = zmq.Context.instance().socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    fake_port = fake.bind_to_random_port("tcp://127.0.0.1")
    try:
        for port in (listener.port, fake_port):
            raw = json.dumps({**pair.body([1, 2, 3, 4, 5], 2, stream=False), "bootstrap_port": port}).encode()
            r = httpx.post(pair.decode.url + "/generate", content=raw, headers=signed(secret_file, "POST", "/generate", raw),
                           timeout=HANDSHAKE_S + 60)
            assert r.status_code >= 400 and "handshake" in r.text, r.text
        captured = listener.join(HANDSHAKE_S + 10)
        assert fake.poll(0) == 0, "the fake prefill received a message"
        assert b"decode-" not in captured and len(captured) < 1024, bytes(captured[:200])
    finally:
        fake.close()
        listener.close()
    pair.wait_whole()
    served(router)


def listening(pid: int) -> set[str]:
    """Local addresses of every listening TCP / bound UDP socket of `pid` and its children."""
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    out = set()
    for p in procs:
        for c in p.net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN or (c.type == socket.SOCK_DGRAM and not c.raddr):
                out.add(c.laddr.ip)
    return out


def test_nothing_listens_beyond_host(pair: PDPair, router: RouterProc) -> None:
    """Item 6: UCX listened on every interface with --host 127.0.0.1."""
    served(router)  # UCX endpoints of both engines are up and connected
    for role in (pair.prefill, pair.decode):
        addrs = listening(role.proc.pid)
        assert addrs and addrs <= {"127.0.0.1", "::1"}, (role.module, addrs)


def test_a_public_bind_without_a_secret_is_refused(tiny_llama_path: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    env["PYTHONPATH"] = str(REPO_ROOT)
    for argv in (["-m", "router", "--model-path", tiny_llama_path, "--prefill", "http://127.0.0.1:1", "1",
                  "--decode", "http://127.0.0.1:2"],
                 ["-m", "decode_server", "--model-path", tiny_llama_path, "--device", "cpu"]):
        out = subprocess.run([sys.executable, *argv, "--host", "0.0.0.0", "--port", "1"], env=env, cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and "--allow-unauthenticated" in out.stdout + out.stderr, out


def test_allow_unauthenticated_is_explicit_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ClusterSecretError, match="--allow-unauthenticated"):
        require_safe_bind("decode", "10.1.2.3", None, allow_unauthenticated=False)
    with caplog.at_level(logging.WARNING):
        require_safe_bind("decode", "10.1.2.3", None, allow_unauthenticated=True)
        require_safe_bind("decode", "127.0.0.1", None, allow_unauthenticated=False)
    assert "WITHOUT a cluster secret" in caplog.text and "unauthenticated (loopback" in caplog.text
    secret = ClusterSecret(secrets.token_bytes(32))
    require_safe_bind("decode", "10.1.2.3", secret, allow_unauthenticated=False)
    assert "hidden" in repr(secret) and "hidden" in repr(secret.router_keys())


def test_m4_a_captured_request_cannot_be_replayed(pair: PDPair, router: RouterProc, tap: WireTap,
                                                    secret_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """M4: the router sent one static bearer in clear on every request, /health probes included; a
    tap on the wire could replay it from anywhere. Now each request carries its own MAC (method,
    target, time, nonce, body hash): replayed as captured, with another body or on another path,
    or signed out of the time window, the prefill refuses it; probes of /health carry nothing."""
    served(router)
    captured = tap.requests()
    generates = [r for r in captured if (r.method, r.path) == ("POST", "/generate")]
    probes = [r for r in captured if r.path == "/health"]
    assert generates and probes, [(r.method, r.path) for r in captured]
    assert all("authorization" not in r.headers for r in probes)
    macs = [r.headers["authorization"] for r in captured if r.path != "/health"]
    assert all(m.startswith(SCHEME + " ") for m in macs) and len(set(macs)) == len(macs), macs
    g = generates[-1]
    head = g.raw[:len(g.raw) - len(g.body)]
    assert send_raw(pair.prefill.port, g.raw) == 403  # as captured: its nonce is spent
    other = json.dumps({**json.loads(g.body), "input_ids": [9, 9, 9]}).encode()
    length = f"Content-Length: {len(g.body)}".encode()
    assert length in head
    assert send_raw(pair.prefill.port, head.replace(length, f"Content-Length: {len(other)}".encode()) + other) == 403
    assert send_raw(pair.prefill.port, head.replace(b"POST /generate ", b"POST /abort_request ") + g.body) == 403
    real_time = time.time
    monkeypatch.setattr("common.request_mac.time.time", lambda: real_time() - 120)
    stale = signed(secret_file, "GET", "/server_info")
    monkeypatch.undo()
    assert httpx.get(pair.prefill.url + "/server_info", headers=stale, timeout=10).status_code == 403
    fresh = signed(secret_file, "GET", "/server_info")
    assert httpx.get(pair.prefill.url + "/server_info", headers=fresh, timeout=10).status_code == 200
    assert httpx.get(pair.prefill.url + "/server_info", headers=fresh, timeout=10).status_code == 403
    pair.wait_whole()
    served(router)


def test_m4_https_worker_urls_are_refused_not_downgraded(tiny_llama_path: str) -> None:
    """M4c: `https://worker` got plain HTTP to port 80 on the hot path; now the router refuses it."""
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    env["PYTHONPATH"] = str(REPO_ROOT)
    out = subprocess.run([sys.executable, "-m", "router", "--model-path", tiny_llama_path, "--worker",
                          "https://127.0.0.1:1"], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "https worker URLs are not supported" in out.stderr, out


def test_l6_weak_secrets_are_refused_and_the_router_holds_only_derived_keys(
        pair: PDPair, router: RouterProc, secret_file: Path, router_keys_file: Path) -> None:
    """L6: a 16-character passphrase was accepted, and the router held the secret itself (with it
    the bootstrap CURVE keys). Now weak secrets are refused, and the router's key file cannot act
    as a decode towards a prefill's bootstrap port nor yields the secret."""
    for weak in (b"hunter2-hunter2!", b"c" * 48, b"ab" * 24):
        with pytest.raises(ClusterSecretError):
            ClusterSecret(weak)
    out = subprocess.run([sys.executable, "-m", "common.cluster_secret", "router-keys"], input=b"hunter2-hunter2!",
                         cwd=REPO_ROOT, capture_output=True, timeout=60)
    assert out.returncode == 2 and b"at least 32 bytes" in out.stderr, out
    raw = router_keys_file.read_bytes()
    assert secret_file.read_bytes().strip() not in raw
    keys = RouterKeys.decode(raw)
    assert keys is not None and keys.events.server_secret == b""
    secret = ClusterSecret.load(str(secret_file))
    assert secret is not None
    bootstrap = secret.curve()
    assert {keys.events.client_public, keys.events.client_secret}.isdisjoint(
        {bootstrap.client_public, bootstrap.client_secret, bootstrap.server_secret})
    as_router = CurveKeys(bootstrap.server_public, b"", keys.events.client_public, keys.events.client_secret)
    for held, answers in ((as_router, False), (bootstrap, True)):
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        CurveSecurity(zmq.Context.instance(), held, 1 << 20).connect(sock)
        try:
            sock.connect(f"tcp://127.0.0.1:{pair.prefill.bootstrap_port}")
            sock.send(encode(InfoQuery()), flags=zmq.NOBLOCK)
            assert bool(sock.poll(int(HANDSHAKE_S * 1000))) is answers
        finally:
            sock.close()
    served(router)
