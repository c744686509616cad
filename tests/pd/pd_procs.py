"""Real prefill and decode instances for PD tests, and a tiny client that plays the router."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.harness.process import REPO_ROOT, ChildProcess, free_port, stop_all, wait_until

__all__ = ["REPO_ROOT", "START_TIMEOUT_S", "PDPair", "PDResult", "RoleProcess", "free_port", "start_pair",
           "wait_healthy_or_stop", "wait_until"]

START_TIMEOUT_S = 120.0


class RoleProcess:
    """`python -m prefill_server|decode_server ...` in its own process group."""

    def __init__(self, module: str, model_dir: Path, *extra: str) -> None:
        self.module = module
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.bootstrap_port = free_port() if module == "prefill_server" else None
        argv = [sys.executable, "-m", module, "--model-path", str(model_dir), "--port", str(self.port),
                "--device", "cpu", "--log-level", os.environ.get("PDSERVE_TEST_LOG_LEVEL", "warning"),
                "--incremental-streaming-output", *extra]  # these tests read delta streams (the default is cumulative)
        if self.bootstrap_port is not None:
            argv += ["--disaggregation-bootstrap-port", str(self.bootstrap_port)]
        self.child = ChildProcess(argv, module)

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        assert self.child.popen is not None
        return self.child.popen

    def log(self) -> str:
        return self.child.log(tail=None)

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_healthy(self, timeout_s: float = START_TIMEOUT_S) -> None:
        self.child.wait_http(self.url + "/health", timeout_s, period_s=0.3)

    def stat(self, name: str) -> float | None:
        text = httpx.get(self.url + "/metrics", timeout=10.0).text
        for line in text.splitlines():
            if line.startswith(f"pdserve_{name} "):
                return float(line.split()[1])
        return None

    def engine_pid(self) -> int:
        return int(httpx.get(self.url + "/server_info", timeout=5.0).json()["engine_pid"])

    def kill9(self) -> None:
        """kill -9 the whole instance (frontend and engine)."""
        self.child.kill9()

    def stop(self) -> None:
        self.child.close()


@dataclass
class PDResult:
    prefill_status: int
    prefill_body: Any
    decode_status: int
    output_ids: list[int] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    error: dict[str, Any] | None = None


@dataclass
class PDPair:
    prefill: RoleProcess
    decode: RoleProcess

    def body(self, prompt: list[int], max_new: int, *, stream: bool = True, room: int | None = None,
             **params: Any) -> dict[str, Any]:
        return {
            "input_ids": prompt, "stream": stream,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True, **params},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": self.prefill.bootstrap_port,
            "bootstrap_room": random.randrange(2**63) if room is None else room,
        }

    async def generate(self, client: httpx.AsyncClient, body: dict[str, Any]) -> PDResult:
        async def prefill() -> tuple[int, Any]:
            r = await client.post(self.prefill.url + "/generate", json={**body, "stream": False})
            return r.status_code, r.json()

        async def decode() -> tuple[int, list[dict[str, Any]], Any]:
            if not body.get("stream"):
                r = await client.post(self.decode.url + "/generate", json=body)
                return r.status_code, [r.json()], r.json()
            events: list[dict[str, Any]] = []
            async with client.stream("POST", self.decode.url + "/generate", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    return r.status_code, [], r.json()
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[6:]))
            return r.status_code, events, None

        (p_status, p_body), (d_status, events, d_err) = await asyncio.gather(prefill(), decode())
        res = PDResult(p_status, p_body, d_status, events=events)
        for ev in events:
            if "error" in ev:
                res.error = ev["error"]
            res.output_ids += ev.get("output_ids", [])
        if d_err is not None and "error" in d_err:
            res.error = d_err["error"]
        return res

    def run(self, bodies: list[dict[str, Any]], timeout_s: float = 120.0) -> list[PDResult]:
        async def main() -> list[PDResult]:
            async with httpx.AsyncClient(timeout=timeout_s) as client:
                return await asyncio.gather(*(self.generate(client, b) for b in bodies))
        return asyncio.run(main())

    def wait_whole(self, timeout_s: float = 20.0) -> None:
        """Both instances idle with every KV page back (free + cached == total)."""
        def whole() -> bool:
            return all(
                role.stat("kv_pages_in_use") == 0 and role.stat("num_running_reqs") == 0
                for role in (self.prefill, self.decode)
            ) and self.decode.stat("num_transfer_queue_reqs") == 0 and self.decode.stat("num_draining_reqs") == 0 \
                and self.prefill.stat("num_inflight_queue_reqs") == 0 and self.prefill.stat("num_bootstrap_queue_reqs") == 0
        assert wait_until(whole, timeout_s, period_s=0.2), (
            f"pools not whole:\nprefill:\n{self.prefill.log()[-2000:]}\ndecode:\n{self.decode.log()[-2000:]}"
        )

    def stop(self) -> None:
        stop_all([self.prefill.child, self.decode.child])


def wait_healthy_or_stop(*roles: RoleProcess) -> None:
    """Waits for every role (started already, so their starts overlap); if any fails to come up,
    stops them all before the error propagates: a fixture never leaks a half-started set."""
    try:
        for role in roles:
            role.wait_healthy()
    except Exception:
        stop_all([role.child for role in roles])
        raise


def start_pair(model_dir: Path, prefill_flags: list[str], decode_flags: list[str]) -> PDPair:
    common = ["--dtype", "float32"]
    pair = PDPair(RoleProcess("prefill_server", model_dir, *common, *prefill_flags),
                  RoleProcess("decode_server", model_dir, *common, *decode_flags))
    wait_healthy_or_stop(pair.prefill, pair.decode)
    return pair
