"""ZMQ ipc:// channels between an instance's frontend and its engine.

    frontend                                      engine
    FrontendChannel.requests (PUSH, bind) ──────> EngineChannel.requests (PULL, connect)
    FrontendChannel.replies  (PULL, bind) <────── EngineChannel.replies  (PUSH, connect)

The frontend binds both sockets (it outlives engine restarts); the engine
connects. Every frame is one msgspec-msgpack message from io_struct. Sends never
block without bound: a send that cannot go out within `timeout_s` (no peer, peer
gone, queue full) raises IpcSendTimeout. The engine reports ready with
`EngineChannel.send_ready(stats)` = StatsResp(seq=READY_SEQ, stats=...).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from common.server.io_struct import (
    ENCODER,
    ENGINE_REPLY_DECODER,
    ENGINE_REQUEST_DECODER,
    EngineReply,
    EngineRequest,
    StatsResp,
)

logger = logging.getLogger(__name__)

READY_SEQ = -1
_SEND_RETRY_S = 0.002


class IpcSendTimeout(RuntimeError):
    """The peer did not take a message within the bound (it is gone, not started, or stuck)."""


@dataclass(frozen=True)
class EngineIpcAddrs:
    """The two ipc:// endpoints of one instance, in a directory of their own (mode 0700, unique
    per launch): another user can neither connect to them nor list them, whatever the umask."""

    dir: str
    requests: str
    replies: str

    @classmethod
    def new(cls, tag: str = "pdserve") -> EngineIpcAddrs:
        path = tempfile.mkdtemp(prefix=f"{tag}_{os.getpid()}_")  # 0700, O_EXCL-style unique
        return cls(dir=path, requests=f"ipc://{path}/req", replies=f"ipc://{path}/rep")

    def remove_files(self) -> None:
        """The directory and all in it (sockets, the step clock)."""
        shutil.rmtree(self.dir, ignore_errors=True)


def _socket(ctx: zmq.Context, kind: int, *, hwm: int = 0) -> zmq.Socket:
    sock = zmq.Socket(ctx, kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM if kind == zmq.PUSH else zmq.RCVHWM, hwm)
    return sock


class EngineChannel:
    """Engine side, synchronous. Owned by the engine's scheduler loop (one thread)."""

    def __init__(self, addrs: EngineIpcAddrs) -> None:
        self._ctx = zmq.Context()
        self._requests = _socket(self._ctx, zmq.PULL)
        self._requests.connect(addrs.requests)
        self._replies = _socket(self._ctx, zmq.PUSH)
        self._replies.connect(addrs.replies)

    def recv_requests(self, timeout_s: float = 0.0) -> list[EngineRequest]:
        """Wait up to timeout_s for the first request, then drain what is queued."""
        out: list[EngineRequest] = []
        if timeout_s > 0 and not self._requests.poll(int(timeout_s * 1000), zmq.POLLIN):
            return out
        while True:
            try:
                frame = self._requests.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                out.append(ENGINE_REQUEST_DECODER.decode(frame))
            except msgspec.DecodeError:
                logger.exception("dropping an undecodable frontend message (%d bytes)", len(frame))

    def send(self, reply: EngineReply, timeout_s: float = 5.0) -> None:
        frame = ENCODER.encode(reply)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._replies.send(frame, zmq.NOBLOCK)
                return
            except zmq.Again:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise IpcSendTimeout(f"frontend did not take a reply within {timeout_s}s") from None
                self._replies.poll(max(1, int(min(remaining, 0.1) * 1000)), zmq.POLLOUT)

    def send_ready(self, stats: dict[str, float], timeout_s: float = 30.0) -> None:
        """Tell the frontend the model is loaded; `stats` carries the pool sizes."""
        self.send(StatsResp(seq=READY_SEQ, stats=stats), timeout_s=timeout_s)

    def close(self) -> None:
        self._requests.close()
        self._replies.close()
        self._ctx.term()


class FrontendChannel:
    """Frontend side, asyncio. Owned by the TokenizerManager (one event loop)."""

    def __init__(self, addrs: EngineIpcAddrs) -> None:
        self._ctx = zmq.asyncio.Context()
        self._requests = _socket(self._ctx, zmq.PUSH)
        self._requests.bind(addrs.requests)
        self._replies = self._ctx.socket(zmq.PULL)
        self._replies.setsockopt(zmq.LINGER, 0)
        self._replies.setsockopt(zmq.RCVHWM, 0)
        self._replies.bind(addrs.replies)
        self.addrs = addrs

    def send_nowait(self, req: EngineRequest) -> bool:
        """Try once without waiting; False when the engine cannot take it now."""
        try:
            self._requests.send(ENCODER.encode(req), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    async def send(self, req: EngineRequest, timeout_s: float = 5.0) -> None:
        frame = ENCODER.encode(req)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._requests.send(frame, zmq.NOBLOCK)
                return
            except zmq.Again:
                if time.monotonic() >= deadline:
                    raise IpcSendTimeout(f"engine did not take a request within {timeout_s}s") from None
                await asyncio.sleep(_SEND_RETRY_S)

    async def recv(self, timeout_s: float | None = None) -> EngineReply | None:
        """Next decodable reply; None if none arrived within timeout_s."""
        while True:
            if timeout_s is not None and not await self._replies.poll(int(timeout_s * 1000)):
                return None
            frame = await self._replies.recv()
            try:
                return ENGINE_REPLY_DECODER.decode(frame)
            except msgspec.DecodeError:
                logger.exception("dropping an undecodable engine message (%d bytes)", len(frame))

    def close(self) -> None:
        self._requests.close()
        self._replies.close()
        self._ctx.term()
        self.addrs.remove_files()
