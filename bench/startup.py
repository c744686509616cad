"""Start-up time of each role on the default model: process start -> /health 200.

    python bench/startup.py [--rounds 3] [--model-path DIR] [--skip-pd-sh]

Per round, one role at a time so they do not share the cores: a prefill instance alone, a
decode instance alone, then the router in front of a healthy prefill + decode pair that has
served one request (router_up_s: its first HTTP answer; router_ready_s: /health 200, which needs
its own prefill -> decode round trip), and `launch/pd.sh` from its start to its
"pd.sh: READY" line (three roles and the round trip). The default model is converted into the
user cache before the first round (not timed). Figures are the median over rounds; the first
round also pays a cold page cache for the weights. Last line:
RESULT {"router_ready_s", "prefill_ready_s", "decode_ready_s", "pd_ready_s", ...}; the *_cpu_s keys are
the CPU seconds each role (with its engine) used to get ready, steadier than wall time on a shared box.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from machine_info import cpu_name  # noqa: E402

from tests.harness.process import ChildProcess, free_port, http_ok  # noqa: E402

TIMEOUT_S = 300.0



CLK_TCK = os.sysconf("SC_CLK_TCK")


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) of the live processes of process group `pgid` (a role and its
    engine): on a shared box the wall-clock figures move with the load, these much less."""
    total = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid:
                total += int(fields[11]) + int(fields[12])
    return total / CLK_TCK


def wait_ready(child: ChildProcess, url: str, t0: float) -> float:
    """Seconds from t0 to the first /health 200 (polled every 20 ms)."""
    deadline = t0 + TIMEOUT_S
    while time.monotonic() < deadline:
        if http_ok(url + "/health", timeout_s=2.0):
            return time.monotonic() - t0
        if not child.alive:
            raise RuntimeError(f"{child.name} exited:\n{child.log()}")
        time.sleep(0.02)
    raise RuntimeError(f"{child.name} not healthy in {TIMEOUT_S} s:\n{child.log()}")


def instance(module: str, model: str) -> tuple[ChildProcess, str, int | None]:
    port = free_port()
    boot = free_port() if module == "prefill_server" else None
    argv = [sys.executable, "-m", module, "--model-path", model, "--port", str(port), "--log-level", "warning"]
    if boot is not None:
        argv += ["--disaggregation-bootstrap-port", str(boot)]
    return ChildProcess(argv, module), f"http://127.0.0.1:{port}", boot


def time_instance(module: str, model: str) -> tuple[float, float]:
    """(seconds to /health 200, CPU seconds of the instance and its engine by then)."""
    t0 = time.monotonic()
    child, url, _ = instance(module, model)
    try:
        return wait_ready(child, url, t0), group_cpu_s(child.pid)
    finally:
        child.close()


def warm_pair(p_url: str, d_url: str, boot: int) -> None:
    """One PD request straight to the pair, so the router's readiness round trip meets warm kernels."""
    body = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 2, "temperature": 0},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": boot, "bootstrap_room": random.randrange(2**63)}

    async def both() -> None:
        async with httpx.AsyncClient(timeout=120) as c:
            rs = await asyncio.gather(c.post(p_url + "/generate", json=body), c.post(d_url + "/generate", json=body))
            for r in rs:
                r.raise_for_status()

    asyncio.run(both())


def time_router(model: str) -> tuple[float, float, float]:
    """(seconds to the router's first HTTP answer, to its /health 200, its CPU seconds by then)
    in front of a warm pair."""
    (p, p_url, boot), (d, d_url, _) = instance("prefill_server", model), instance("decode_server", model)
    try:
        for child, url in ((p, p_url), (d, d_url)):
            wait_ready(child, url, time.monotonic())
        assert boot is not None
        warm_pair(p_url, d_url, boot)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        t0 = time.monotonic()
        router = ChildProcess([sys.executable, "-m", "router", "--model-path", model, "--port", str(port),
                               "--log-level", "warning", "--prefill", p_url, str(boot), "--decode", d_url], "router")
        try:
            while not http_ok(url + "/health", status=None, timeout_s=2.0):
                if not router.alive or time.monotonic() - t0 > TIMEOUT_S:
                    raise RuntimeError(f"router never answered:\n{router.log()}")
                time.sleep(0.02)
            up = time.monotonic() - t0
            return up, wait_ready(router, url, t0), group_cpu_s(router.pid)
        finally:
            router.close()
    finally:
        p.close()
        d.close()


def time_pd_sh(model: str) -> float:
    """launch/pd.sh start -> its READY line; then SIGTERM, which stops every role it started."""
    with tempfile.TemporaryDirectory(prefix="pdserve_startup_") as logs:
        argv = ["bash", str(REPO / "launch" / "pd.sh"), "--model-path", model, "--port", str(free_port()),
                "--prefill-port", str(free_port()), "--decode-port", str(free_port()),
                "--bootstrap-port", str(free_port()), "--log-dir", logs, "--python", sys.executable]
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        assert proc.stdout is not None
        lines = []
        try:
            for line in proc.stdout:
                lines.append(line)
                if "pd.sh: READY" in line:
                    return time.monotonic() - t0
                if time.monotonic() - t0 > TIMEOUT_S:
                    break
            raise RuntimeError("pd.sh never printed READY:\n" + "".join(lines[-40:]))
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model-path", default=None, help="checkpoint dir (default: the default model)")
    ap.add_argument("--skip-pd-sh", action="store_true", help="leave out pd_ready_s")
    args = ap.parse_args()
    from common.model.default_model import resolve_model_path

    model = str(resolve_model_path(args.model_path))
    runs: dict[str, list[float]] = {k: [] for k in ("prefill_ready_s", "decode_ready_s", "router_up_s",
                                                    "router_ready_s", "pd_ready_s", "prefill_cpu_s",
                                                    "decode_cpu_s", "router_cpu_s")}
    for r in range(args.rounds):
        for role, module in (("prefill", "prefill_server"), ("decode", "decode_server")):
            ready, cpu = time_instance(module, model)
            runs[f"{role}_ready_s"].append(ready)
            runs[f"{role}_cpu_s"].append(cpu)
        up, ready, cpu = time_router(model)
        runs["router_up_s"].append(up)
        runs["router_ready_s"].append(ready)
        runs["router_cpu_s"].append(cpu)
        if not args.skip_pd_sh:
            runs["pd_ready_s"].append(time_pd_sh(model))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in runs.items() if v), flush=True)
    result: dict[str, object] = {k: round(statistics.median(v), 2) for k, v in runs.items() if v}
    result.update(runs={k: [round(x, 2) for x in v] for k, v in runs.items() if v}, model=Path(model).name,
                  cpu=cpu_name(), cores=os.cpu_count(), load_avg=round(os.getloadavg()[0], 1))
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
