"""router.http_client against real asyncio TCP servers speaking raw HTTP/1.1."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from router.http_client import ConnectFailed, ConnectionLost, HttpClient
from tests.router.router_procs import free_port

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(r: asyncio.StreamReader) -> bytes:
    head = await r.readuntil(b"\r\n\r\n")
    length = [int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")]
    return await r.readexactly(length[0]) if length else b""


async def serve(handler: Handler) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


async def test_chunked_and_content_length_with_keep_alive() -> None:
    connections = 0

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while True:
            try:
                body = await _read_request(r)
            except asyncio.IncompleteReadError:
                return
            if body == b"chunked":
                w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                        b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: y\r\n\r\n")
            else:
                w.write(b"HTTP/1.1 201 Created\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            await w.drain()

    server, url = await serve(handler)
    client = HttpClient()
    try:
        for _ in range(3):
            resp = await client.post(url, "/x", b"chunked", {})
            assert resp.status == 200 and [c async for c in resp.iter_body()] == [b"hello", b" world"]
            await resp.aclose()
            resp = await client.post(url, "/x", b"echo me", {"X-Request-Id": "a"})
            assert resp.status == 201 and await resp.read() == b"echo me"
            await resp.aclose()
        assert connections == 1  # every request reused the one connection
    finally:
        await client.aclose()
        server.close()


async def test_stale_pooled_connection_is_retried_and_errors_are_typed() -> None:
    async def close_after_one(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await w.drain()
        w.close()  # keep-alive was promised, but the server drops the connection

    server, url = await serve(close_after_one)
    client = HttpClient()
    try:
        for _ in range(3):
            resp = await client.post(url, "/", b"{}", {})
            assert await resp.read() == b"ok"
            await resp.aclose()  # pooled; the next request finds it closed (at EOF or on first read)
    finally:
        server.close()

    async def truncated(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort")
        await w.drain()
        w.close()

    server, url = await serve(truncated)
    try:
        resp = await client.post(url, "/", b"{}", {})
        with pytest.raises(ConnectionLost):
            await resp.read()
        await resp.aclose()
    finally:
        server.close()
        await client.aclose()
    with pytest.raises(ConnectFailed):
        await client.post(f"http://127.0.0.1:{free_port()}", "/", b"{}", {})
