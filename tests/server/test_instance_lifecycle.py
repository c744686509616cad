"""Instance process lifecycle: engine death, failed start, orphaned engine, prefill role."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from typing import Any

import httpx

from tests.server.server_procs import pid_alive, wait_until


def test_engine_killed_fails_in_flight_requests_and_health(start_server: Any, tokenizer: Any) -> None:
    server = start_server()
    engine_pid = server.engine_pid()
    ids = tokenizer.encode("Hello world")
    long = {"max_new_tokens": 1000}

    async def run() -> tuple[httpx.Response, list[str]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=10.0) as client:
            plain = asyncio.ensure_future(
                client.post("/generate", json={"input_ids": ids, "sampling_params": long})
            )
            lines: list[str] = []
            payload = {"input_ids": ids, "stream": True, "sampling_params": long}
            async with client.stream("POST", "/generate", json=payload) as resp:
                async for line in resp.aiter_lines():
                    if line and not lines:
                        os.kill(engine_pid, signal.SIGKILL)
                    if line:
                        lines.append(line)
            return await plain, lines

    plain, lines = asyncio.run(run())  # within the client's 10 s timeout, else httpx raises
    assert plain.status_code == 500
    assert plain.json()["error"] == {
        "message": "the engine process died: killed by signal SIGKILL",
        "type": "engine_died",
        "code": 500,
    }
    assert lines[-1] == "data: [DONE]"
    assert '"type":"engine_died"' in lines[-2]
    health = httpx.get(server.url + "/health", timeout=5.0)
    assert health.status_code == 503 and health.json()["error"]["type"] == "unavailable"
    again = httpx.post(server.url + "/generate", json={"input_ids": ids}, timeout=5.0)
    assert again.status_code == 503 and "not running" in again.json()["error"]["message"]
    assert server.server_info()["engine_alive"] is False
    assert server.stop() == 0


def test_engine_crash_before_ready_fails_the_launch_fast(start_server: Any) -> None:
    started = time.monotonic()
    server = start_server("--disaggregation-fault-spec", "crash_on_start", healthy=False)
    assert server.proc.wait(30) == 1
    assert time.monotonic() - started < 30
    log = server.log()
    assert "injected crash before ready" in log
    assert "the engine process exited with code 1 before it was ready" in log


def test_prefill_role_answers_meta_only_and_engine_dies_with_its_frontend(
    start_server: Any, tokenizer: Any
) -> None:
    server = start_server("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "1")
    ids = tokenizer.encode("Hello world")
    missing = httpx.post(server.url + "/generate", json={"input_ids": ids}, timeout=5.0)
    assert missing.status_code == 400 and "bootstrap" in missing.json()["error"]["message"]
    payload: dict[str, Any] = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 1},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": 1,
        "bootstrap_room": 2**63 - 1,
    }
    resp = httpx.post(server.url + "/generate", json=payload, timeout=5.0).json()
    assert resp["text"] == "" and resp["output_ids"] == []
    assert resp["meta_info"]["finish_reason"] == {"type": "length"}
    assert resp["meta_info"]["prompt_tokens"] == len(ids)
    assert server.server_info()["bootstrap_port"] == 1

    engine_pid = server.engine_pid()
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(5)
    assert wait_until(lambda: not pid_alive(engine_pid), timeout_s=5.0), "engine outlived its frontend"


def test_port_in_use_fails_before_the_engine_starts(start_server: Any) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        server = start_server("--port", str(port), "--log-level", "info", healthy=False)
        assert server.proc.wait(30) == 1
    assert f"cannot serve on 127.0.0.1:{port}" in server.log()
    assert "engine process started" not in server.log()


def _stream_through_sigterm(server: Any, ids: list[int], pause_s: float) -> tuple[list[str], str | None]:
    """Stream a long request; after its first chunk SIGTERM the instance and pause its engine
    for pause_s (the request cannot finish before then). Returns the lines read and the
    error that ended the stream early, if any."""
    engine_pid = server.engine_pid()
    payload = {"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": 64, "ignore_eos": True}}
    lines: list[str] = []
    with httpx.Client(timeout=30.0) as client:
        try:
            with client.stream("POST", server.url + "/generate", json=payload) as resp:
                for line in resp.iter_lines():
                    if line and not lines:
                        os.kill(engine_pid, signal.SIGSTOP)
                        server.proc.send_signal(signal.SIGTERM)
                        time.sleep(0.5)  # uvicorn closes its listener on the signal
                        try:
                            httpx.get(server.url + "/health", timeout=2.0)
                            refused = False
                        except httpx.ConnectError:
                            refused = True
                        assert refused, "a draining instance still accepts connections"
                        time.sleep(pause_s)
                        os.kill(engine_pid, signal.SIGCONT)
                    if line:
                        lines.append(line)
        except httpx.HTTPError as e:
            return lines, type(e).__name__
    return lines, None


def test_sigterm_lets_in_flight_requests_finish(start_server: Any, tokenizer: Any) -> None:
    """Rolling restart: SIGTERM refuses new connections at once (a router retries elsewhere)
    and lets the in-flight stream finish, here after its engine stalled past 5 s."""
    server = start_server("--graceful-shutdown-timeout", "30")
    lines, error = _stream_through_sigterm(server, tokenizer.encode("Hello world"), pause_s=6.0)
    assert error is None and lines[-1] == "data: [DONE]"
    tokens = [t for line in lines[:-1] for t in json.loads(line.removeprefix("data: "))["output_ids"]]
    assert len(tokens) == 64
    assert server.proc.wait(30) == 0


def test_sigterm_past_the_graceful_timeout_cuts_the_stream_visibly(start_server: Any, tokenizer: Any) -> None:
    server = start_server("--graceful-shutdown-timeout", "1")
    lines, error = _stream_through_sigterm(server, tokenizer.encode("Hello world"), pause_s=3.0)
    # The client sees a broken stream (no [DONE], transport error), never a clean short answer.
    assert error is not None and lines[-1] != "data: [DONE]", (error, lines[-2:])
    server.proc.wait(30)
