"""A small keep-alive HTTP/1.1 client for the router's hot path (router -> worker /generate).

Why not httpx here: its connection pool polls every pooled socket on each request
(O(connections) syscalls per request), which measured as most of the router's CPU
per request. This client keeps, per worker origin, a LIFO list of idle
connections and never scans it.

    client = HttpClient(max_per_origin=1024, connect_timeout=5.0)
    resp = await client.post(origin, "/generate", body, headers)   # status + headers read
                                                     # (plus a per-request MAC: see common.request_mac)
    async for chunk in resp.iter_body(): ...                       # de-chunked body bytes
    await resp.aclose()   # fully read -> connection back to the pool; else closed

Only what workers speak: POST/GET, a Content-Length request body, responses framed by
Content-Length or chunked transfer coding (or read-to-close). Every failure is an
HttpError subclass; a pooled connection the server closed while idle is retried once
on a fresh one (nothing of the response was read, so the request was not processed).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

from common.request_mac import RequestSigner
from common.timeouts import wait_within


class HttpError(Exception):
    pass


class ConnectFailed(HttpError):
    pass


class ConnectionLost(HttpError):
    pass


class _Conn:
    __slots__ = ("reader", "writer", "idle_since")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_since = 0.0

    def close(self) -> None:
        self.writer.close()


class Response:
    """Status and headers are read; the body is read through `read()` or `iter_body()`."""

    def __init__(self, pool: _OriginPool, conn: _Conn, status: int, headers: dict[str, str]) -> None:
        self.status = status
        self.headers = headers
        self._pool = pool
        self._conn: _Conn | None = conn
        te = headers.get("transfer-encoding", "").lower()
        self._chunked = "chunked" in te
        length = headers.get("content-length")
        self._length = int(length) if length is not None and not self._chunked else None
        self._reusable = headers.get("connection", "").lower() != "close" and (self._chunked or length is not None)
        self._complete = False

    async def read(self) -> bytes:
        return b"".join([c async for c in self.iter_body()])

    async def iter_body(self) -> AsyncIterator[bytes]:
        conn = self._conn
        if conn is None or self._complete:
            return
        r = conn.reader
        try:
            if self._chunked:
                while True:
                    line = await r.readuntil(b"\r\n")
                    size = int(line.split(b";", 1)[0], 16)
                    if size == 0:
                        while await r.readuntil(b"\r\n") != b"\r\n":  # trailers
                            pass
                        break
                    data = await r.readexactly(size + 2)
                    yield data[:-2]
            elif self._length is not None:
                if self._length:
                    yield await r.readexactly(self._length)
            else:
                while data := await r.read(65536):
                    yield data
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError) as e:
            self._reusable = False
            raise ConnectionLost(f"connection lost while reading the body: {type(e).__name__}") from None
        self._complete = True

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._complete and self._reusable:
            self._pool.release(conn)
        else:
            self._pool.discard(conn)


class _OriginPool:
    def __init__(self, host: str, port: int, limit: int, connect_timeout: float, idle_timeout: float) -> None:
        self.host = host
        self.port = port
        self.host_header = f"{host}:{port}".encode()
        self.connect_timeout = connect_timeout
        self.idle_timeout = idle_timeout
        self.idle: list[_Conn] = []
        self.slots = asyncio.Semaphore(limit)

    async def acquire(self) -> tuple[_Conn, bool]:
        """A connection (reused: True) - the caller holds one slot until release/discard."""
        await self.slots.acquire()
        now = time.monotonic()
        while self.idle:
            conn = self.idle.pop()
            if now - conn.idle_since < self.idle_timeout and not conn.reader.at_eof():
                return conn, True
            conn.close()
        try:
            reader, writer = await wait_within(asyncio.open_connection(self.host, self.port),
                                               self.connect_timeout, discard=lambda rw: rw[1].close())
        except (OSError, asyncio.TimeoutError) as e:
            self.slots.release()
            raise ConnectFailed(f"cannot connect to {self.host}:{self.port}: {e or type(e).__name__}") from None
        except BaseException:
            self.slots.release()
            raise
        return _Conn(reader, writer), False

    def release(self, conn: _Conn) -> None:
        conn.idle_since = time.monotonic()
        self.idle.append(conn)
        self.slots.release()

    def discard(self, conn: _Conn) -> None:
        conn.close()
        self.slots.release()

    def close_idle(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle.clear()


class HttpClient:
    """Owned by the Dispatcher; one per router. Not thread-safe (one event loop)."""

    def __init__(self, max_per_origin: int = 1024, connect_timeout: float = 5.0, idle_timeout: float = 4.0,
                 signer: RequestSigner | None = None) -> None:
        self.max_per_origin = max_per_origin
        self.signer = signer
        self.connect_timeout = connect_timeout
        self.idle_timeout = idle_timeout  # below uvicorn's default keep-alive (5 s)
        self._pools: dict[str, _OriginPool] = {}

    def _pool(self, origin: str) -> _OriginPool:
        pool = self._pools.get(origin)
        if pool is None:
            parts = urlsplit(origin)
            pool = _OriginPool(parts.hostname or "127.0.0.1", parts.port or 80, self.max_per_origin,
                               self.connect_timeout, self.idle_timeout)
            self._pools[origin] = pool
        return pool

    async def post(self, origin: str, path: str, body: bytes, headers: dict[str, str]) -> Response:
        pool = self._pool(origin)
        head = [b"POST ", path.encode(), b" HTTP/1.1\r\nHost: ", pool.host_header,
                b"\r\nContent-Length: ", str(len(body)).encode(), b"\r\n"]
        if self.signer is not None:
            head += [b"Authorization: ", self.signer.sign("POST", path, body).encode(), b"\r\n"]
        for k, v in headers.items():
            head += [k.encode(), b": ", v.encode("latin-1"), b"\r\n"]
        head.append(b"\r\n")
        request = b"".join(head) + body
        for _ in range(2):
            conn, reused = await pool.acquire()
            try:
                conn.writer.write(request)
                if conn.writer.transport.get_write_buffer_size() > 1 << 16:
                    await conn.writer.drain()
                status, resp_headers = await _read_head(conn.reader)
            except (asyncio.IncompleteReadError, ConnectionError) as e:
                pool.discard(conn)
                stale = reused and (not isinstance(e, asyncio.IncompleteReadError) or not e.partial)
                if stale:
                    continue  # the server closed the idle connection before reading the request
                raise ConnectionLost(f"{origin}: connection lost before the response: {type(e).__name__}") from None
            except (ValueError, asyncio.LimitOverrunError) as e:
                pool.discard(conn)
                raise ConnectionLost(f"{origin}: malformed response head: {e}") from None
            except BaseException:
                pool.discard(conn)
                raise
            return Response(pool, conn, status, resp_headers)
        raise ConnectionLost(f"{origin}: connection closed by the server twice")

    async def aclose(self) -> None:
        for pool in self._pools.values():
            pool.close_idle()


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    while True:
        raw = await reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
            raise ValueError(f"bad status line {lines[0][:100]!r}")
        status = int(parts[1])
        if 100 <= status < 200:
            continue  # 100 Continue and friends
        headers = {}
        for line in lines[1:]:
            if line:
                k, _, v = line.partition(":")
                headers[k.strip().lower()] = v.strip()
        return status, headers
