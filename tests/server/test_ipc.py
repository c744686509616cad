"""The frontend <-> engine ZMQ channels over real ipc:// sockets (engine side in a thread)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from common.sampling_params import SamplingParams
from common.server.io_struct import (
    AbortReq,
    BatchTokenOut,
    FinishReason,
    GenerateReq,
    StatsReq,
    StatsResp,
    TokenOut,
)
from common.server.ipc import READY_SEQ, EngineChannel, EngineIpcAddrs, FrontendChannel, IpcSendTimeout


def _echo_engine(addrs: EngineIpcAddrs, n_msgs: int, seen: list[object]) -> None:
    engine = EngineChannel(addrs)
    try:
        engine.send_ready({"max_total_tokens": 128.0})
        while len(seen) < n_msgs:
            for msg in engine.recv_requests(timeout_s=1.0):
                seen.append(msg)
                if isinstance(msg, GenerateReq):
                    out = TokenOut(msg.rid, [7, 8], FinishReason("length"), len(msg.input_ids), 2, 0)
                    engine.send(BatchTokenOut([out]))
                elif isinstance(msg, StatsReq):
                    engine.send(StatsResp(msg.seq, {"num_running_reqs": 0.0}))
    finally:
        engine.close()


def test_messages_round_trip_both_ways() -> None:
    addrs = EngineIpcAddrs.new("pdserve_test")
    seen: list[object] = []

    async def run() -> list[object]:
        frontend = FrontendChannel(addrs)
        thread = threading.Thread(target=_echo_engine, args=(addrs, 3, seen))
        thread.start()
        try:
            ready = await frontend.recv(timeout_s=5.0)
            assert ready == StatsResp(READY_SEQ, {"max_total_tokens": 128.0})
            req = GenerateReq("r1", [1, 2, 3], SamplingParams(max_new_tokens=2, stop=["x"]))
            await frontend.send(req)
            tokens = await frontend.recv(timeout_s=5.0)
            await frontend.send(StatsReq(seq=4))
            stats = await frontend.recv(timeout_s=5.0)
            await frontend.send(AbortReq("r1"))
            return [tokens, stats]
        finally:
            await asyncio.to_thread(thread.join, 5.0)
            frontend.close()

    tokens, stats = asyncio.run(run())
    assert tokens == BatchTokenOut([TokenOut("r1", [7, 8], FinishReason("length"), 3, 2, 0)])
    assert stats == StatsResp(4, {"num_running_reqs": 0.0})
    assert seen[0] == GenerateReq("r1", [1, 2, 3], SamplingParams(max_new_tokens=2, stop=["x"]))
    assert seen[1:] == [StatsReq(4), AbortReq("r1")]


def test_send_without_an_engine_is_bounded() -> None:
    async def run() -> None:
        frontend = FrontendChannel(EngineIpcAddrs.new("pdserve_test"))
        try:
            assert frontend.send_nowait(StatsReq(1)) is False
            with pytest.raises(IpcSendTimeout):  # bounded by the timeout (the test's own timeout otherwise)
                await asyncio.wait_for(frontend.send(StatsReq(1), timeout_s=0.2), 30.0)
            assert await frontend.recv(timeout_s=0.05) is None
        finally:
            frontend.close()

    asyncio.run(run())
