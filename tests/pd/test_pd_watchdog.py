"""The watchdog covers the whole engine thread, not only the forward step (issue 41, item 3).

A prefill whose transfer poll hangs (`--engine-fault-spec hang,at=transfer_poll`) and a decode
whose bootstrap handling hangs (`hang,at=bootstrap`) each get one request with bootstrap info;
the engine thread then never comes back. /health must turn 503 naming the phase within
--watchdog-timeout (plus the watchdog's period and the probe), the request must get an error,
and the instance must end. Before the fix the clock read "idle" and /health said 200 forever.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.pd.pd_procs import RoleProcess, free_port

WATCHDOG_S = 3.0
SLACK_S = 2.0  # the watchdog's 0.25 s period, the probe's own time, a loaded box


@pytest.mark.parametrize(("module", "place", "phase"), [
    ("prefill_server", "transfer_poll", "transfer poll"),
    ("decode_server", "bootstrap", "bootstrap handling"),
])
def test_a_hang_outside_the_step_turns_health_503(tiny_llama_path: str, module: str, place: str,
                                                   phase: str) -> None:
    role = RoleProcess(module, Path(tiny_llama_path), "--max-total-tokens", "2048",
                       "--watchdog-timeout", f"{WATCHDOG_S:g}", "--engine-fault-spec", f"hang,at={place}")
    try:
        role.wait_healthy()
        assert httpx.get(role.url + "/health", timeout=5.0).status_code == 200
        body = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 2},
                "bootstrap_host": "127.0.0.1", "bootstrap_port": free_port(), "bootstrap_room": 7}
        answer: list[httpx.Response] = []
        sender = threading.Thread(target=lambda: answer.append(
            httpx.post(role.url + "/generate", json=body, timeout=60.0)), daemon=True)
        t0 = time.monotonic()
        sender.start()
        health = None
        while time.monotonic() - t0 < WATCHDOG_S + SLACK_S + 5:
            try:
                health = httpx.get(role.url + "/health", timeout=2.0)
            except httpx.HTTPError:
                break  # the instance already ended
            if health.status_code == 503:
                break
            time.sleep(0.1)
        took = time.monotonic() - t0
        assert health is not None and health.status_code == 503, (health, role.log()[-3000:])
        assert f"hung in its {phase}" in health.text, health.text
        assert took <= WATCHDOG_S + SLACK_S, took
        sender.join(30)
        assert answer and answer[0].status_code == 503 and "hung" in answer[0].text, answer
        role.proc.wait(30)  # the hung instance ends itself
    finally:
        role.stop()
