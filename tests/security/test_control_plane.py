"""Issue 23, items 2, 3 and 6, replayed against real processes: a prefill and a decode instance
and the router, all holding one cluster secret (a 0600 file). Workers refuse every call
without it but /health and /metrics, a real decode tells a fake prefill nothing, nothing of
ours listens beyond --host, and a non-loopback bind without a secret is refused."""

from __future__ import annotations

import logging
import os
import secrets
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import zmq

from common.cluster_secret import ENV_VAR, ClusterSecret, ClusterSecretError, require_safe_bind
from tests.pd.pd_procs import REPO_ROOT, PDPair, start_pair
from tests.router.router_procs import RouterProc
from tests.security.byte_capture import ByteCapture

HANDSHAKE_S = 3.0


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("secret") / "cluster_secret"
    path.write_text(secrets.token_hex(32))
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def pair(tiny_llama_path: str, secret_file: Path) -> Iterator[PDPair]:
    flags = ["--cluster-secret-file", str(secret_file), "--disaggregation-handshake-timeout", str(HANDSHAKE_S)]
    pd = start_pair(Path(tiny_llama_path), flags, flags)
    try:
        yield pd
    finally:
        pd.stop()


@pytest.fixture(scope="module")
def router(pair: PDPair, tiny_llama_path: str, secret_file: Path) -> Iterator[RouterProc]:
    proc = RouterProc(tiny_llama_path, ["--prefill", pair.prefill.url, str(pair.prefill.bootstrap_port),
                                        "--decode", pair.decode.url, "--cluster-secret-file", str(secret_file)],
                      wait=False)
    try:
        proc.wait_ready(timeout=120)
        yield proc
    finally:
        proc.stop()


def bearer(secret_file: Path) -> dict[str, str]:
    secret = ClusterSecret.load(str(secret_file))
    assert secret is not None
    return {"Authorization": secret.bearer()}


def served(router: RouterProc) -> None:
    r = httpx.post(router.url + "/generate", timeout=60,
                   json={"input_ids": [5, 6, 7, 8, 9], "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 4, r.text


def test_workers_answer_only_the_router(pair: PDPair, router: RouterProc, secret_file: Path) -> None:
    """Item 2: /generate and /abort_request were open to anyone who reached a worker."""
    served(router)
    for role in (pair.prefill, pair.decode):
        body = pair.body([1, 2, 3], 2, stream=False)
        for headers, status in (({}, 401), ({"Authorization": "Bearer " + "0" * 64}, 403)):
            r = httpx.post(role.url + "/generate", json=body, headers=headers, timeout=10)
            assert r.status_code == status and r.json()["error"]["code"] == status, r.text
            assert httpx.post(role.url + "/abort_request", json={"rid": "any"}, headers=headers,
                              timeout=10).status_code == status
            for path in ("/server_info", "/health_generate"):
                assert httpx.get(role.url + path, headers=headers, timeout=10).status_code == status
        assert httpx.post(role.url + "/generate", json=body, timeout=10).headers["www-authenticate"].startswith("Bearer")
        assert httpx.get(role.url + "/health", timeout=10).status_code == 200
        assert httpx.get(role.url + "/metrics", timeout=10).status_code == 200
        assert httpx.get(role.url + "/server_info", headers=bearer(secret_file), timeout=10).status_code == 200
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
            body = {**pair.body([1, 2, 3, 4, 5], 2, stream=False), "bootstrap_port": port}
            r = httpx.post(pair.decode.url + "/generate", json=body, headers=bearer(secret_file),
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
    assert secret.accepts(secret.bearer()) and not secret.accepts("Bearer x") and not secret.accepts(None)
    assert "hidden" in repr(secret)
