"""Attack clients for the front-door tests: slow sockets, a reader that never reads, metrics.

The processes themselves come from the existing helpers (tests/router/router_procs.py for
routers and stub workers, tests/server/server_procs.py for instances on the fake engine).
"""

from __future__ import annotations

import contextlib
import json
import resource
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.harness.process import wait_until

DISTRO_SOFT_NOFILE = 1024  # the soft open-file limit most distributions start processes with


@contextlib.contextmanager
def distro_nofile_limit() -> Iterator[None]:
    """Processes started inside inherit a soft RLIMIT_NOFILE of 1,024 (the hard limit is kept),
    as under a stock systemd/login session; this test process gets its own limit back after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(DISTRO_SOFT_NOFILE, soft), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def raise_own_nofile(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))


class SlowSockets:
    """`n` connections that each send a partial request head and then nothing."""

    HEAD = b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"

    def __init__(self, port: int, n: int) -> None:
        raise_own_nofile(n + 512)
        self.socks: list[socket.socket] = []
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(self.HEAD)
            self.socks.append(s)

    def wait_all_closed(self, timeout_s: float) -> int:
        """How many the server closed (EOF or reset) within timeout_s."""
        deadline = time.monotonic() + timeout_s
        closed = 0
        for s in self.socks:
            s.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                if s.recv(4096) == b"":
                    closed += 1
            except (ConnectionResetError, BrokenPipeError):
                closed += 1
            except TimeoutError:
                pass
        return closed

    def close(self) -> None:
        for s in self.socks:
            s.close()


class NonReader:
    """A streaming client that sends its request and never reads (tiny receive buffer)."""

    def __init__(self, port: int, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect(("127.0.0.1", port))
        raw = json.dumps(body).encode()
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{extra}"
                f"Content-Length: {len(raw)}\r\n\r\n")
        self.sock.sendall(head.encode() + raw)

    def read_to_eof(self, timeout_s: float) -> bytes:
        """Everything the server sent; AssertionError if the connection is still open after timeout_s."""
        deadline = time.monotonic() + timeout_s
        chunks = []
        while True:
            left = deadline - time.monotonic()
            assert left > 0, "the server never closed the connection"
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(1 << 16)
            except ConnectionResetError:
                break
            if not data:
                break
            chunks.append(data)
        self.sock.close()
        return b"".join(chunks)


def metric(url: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of a metric's samples named `name` (with these labels) at url/metrics; 0 if absent."""
    return metric_value(httpx.get(url + "/metrics", timeout=5).text, name, **(labels or {}))


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples named `name` (with these labels) in Prometheus text; 0 if absent."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def wait_for(cond: Any, timeout_s: float, what: str) -> None:
    assert wait_until(cond, timeout_s), f"not within {timeout_s}s: {what}"


class PartialBody:
    """A request whose head declares `declared` body bytes, of which the client sends only what
    `send` is told to: the attacker of a slow body (security review 2, M2)."""

    def __init__(self, port: int, path: str, declared: int, headers: dict[str, str] | None = None,
                 content_type: str = "application/json") -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n{extra}"
                f"Content-Length: {declared}\r\n\r\n")
        self.sock.sendall(head.encode())
        self.started = time.monotonic()
        self.answer = b""

    def send(self, data: bytes) -> bool:
        """False once the server has closed the connection."""
        try:
            self.sock.sendall(data)
            return True
        except (BrokenPipeError, ConnectionResetError):
            return False

    def trickle_until_closed(self, chunk: bytes, every_s: float, timeout_s: float) -> float:
        """Send `chunk` every `every_s` until the server closes; seconds from the head to the close.
        AssertionError if it is still open after timeout_s."""
        self.sock.setblocking(False)
        while time.monotonic() - self.started < timeout_s:
            if self.closed() or not self.send(chunk):
                return time.monotonic() - self.started
            time.sleep(every_s)
        raise AssertionError(f"the server kept a trickled body open for {timeout_s}s")

    def closed(self) -> bool:
        """True if the server closed (EOF or reset); reads and drops any answer."""
        self.sock.setblocking(False)
        try:
            while True:
                data = self.sock.recv(1 << 16)
                if not data:
                    return True
                self.answer += data
        except BlockingIOError:
            return False
        except (ConnectionResetError, BrokenPipeError):
            return True

    def close(self) -> None:
        self.sock.close()
