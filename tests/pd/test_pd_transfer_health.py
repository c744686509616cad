"""A role whose KV transfer thread died: /health says so (503, the reason), new requests get
503 (a router sends them elsewhere), and the instance keeps answering instead of hanging."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from tests.pd.pd_procs import RoleProcess


def test_dead_transfer_thread_turns_health_503(tiny_llama_path: str) -> None:
    decode = RoleProcess("decode_server", Path(tiny_llama_path), "--max-total-tokens", "256",
                         "--disaggregation-fault-spec", "crash_after_s=2")
    try:
        decode.wait_healthy()
        deadline = time.monotonic() + 30
        while decode.healthy():
            assert time.monotonic() < deadline, "health never reported the dead transfer thread"
            time.sleep(0.2)
        r = httpx.get(decode.url + "/health", timeout=5)
        assert r.status_code == 503 and "KV transfer thread is not running" in r.json()["error"]["message"]
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4},
                "bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": 7}
        r = httpx.post(decode.url + "/generate", json=body, timeout=10)
        assert r.status_code == 503, r.text
        assert "cannot transfer KV" in r.json()["error"]["message"]
        assert decode.proc.poll() is None
    finally:
        decode.stop()
