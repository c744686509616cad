"""Routing policies on one skewed 2P1D cluster: load_aware vs cache_aware vs power_of_two.

    python bench/policy_compare.py [--model-path DIR] [--slow-step-s 0.03] [--num-prompts 60]
                                   [--rounds 3] [--request-rate 6] [--slo-ttft-ms 400]

One cluster, started once: prefill `fast`, prefill `slow` (every forward made slow_step_s
longer with --engine-fault-spec, as a CPU-heavy neighbour would), one decode; then three
routers over those same instances, one per policy (--policy for both roles). bench/serving.py
replays the same skewed workload (half the prompts behind one long shared prefix) on each
router, interleaved in --rounds (round k starts at router k), so load drift on a shared box
hits every policy alike. Default model: a tiny random llama (routing is what is measured).
Prints serving.py's table, where each policy sent the prompts (requests per prefill), the CPU,
and a last RESULT line: serving.py's result (TTFT p50/p99, goodput per policy) plus that split.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from machine_info import cpu_name

REPO = Path(__file__).resolve().parents[1]
POLICIES = ("load_aware", "cache_aware", "power_of_two")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    def __init__(self, name: str, argv: list[str], log_dir: Path) -> None:
        self.name = name
        self.log = open(log_dir / f"{name}.log", "wb")  # noqa: SIM115 (closed in stop)
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen([sys.executable, "-m", *argv], cwd=REPO, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, url: str, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited ({self.proc.returncode}); see {self.log.name}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise SystemExit(f"{self.name} not healthy within {timeout_s}s; see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()



def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", help="default: a tiny random llama built here")
    p.add_argument("--slow-step-s", type=float, default=0.03)
    p.add_argument("--num-prompts", type=int, default=60)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--request-rate", type=float, default=6.0)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--input-len", type=int, default=384)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--slo-ttft-ms", type=float, default=400.0)
    p.add_argument("--instance-args", default="", help="extra flags for every instance")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="policy_compare_"))
    model = args.model_path
    if model is None:
        from common.model.testing import build_tiny_checkpoint

        model = str(build_tiny_checkpoint(log_dir / "tiny", "llama"))
    base = ["--model-path", model, "--device", "cpu", "--log-level", "warning", *args.instance_args.split()]
    procs: list[Proc] = []
    try:
        prefills: list[tuple[str, int]] = []
        for name, extra in (("fast", []), ("slow", ["--engine-fault-spec", f"slow_step_s={args.slow_step_s}"])):
            port, boot = free_port(), free_port()
            procs.append(Proc(f"prefill_{name}", ["prefill_server", *base, "--port", str(port),
                                                  "--disaggregation-bootstrap-port", str(boot), *extra], log_dir))
            prefills.append((f"http://127.0.0.1:{port}", boot))
        d_port = free_port()
        procs.append(Proc("decode", ["decode_server", *base, "--port", str(d_port)], log_dir))
        for p, (url, _) in zip(procs, [*prefills, (f"http://127.0.0.1:{d_port}", 0)], strict=True):
            p.wait(url)
        routers = []
        for policy in POLICIES:
            port = free_port()
            argv = ["router", "--model-path", model, "--port", str(port), "--policy", policy,
                    "--decode", f"http://127.0.0.1:{d_port}", "--log-level", "warning"]
            for url, boot in prefills:
                argv += ["--prefill", url, str(boot)]
            procs.append(Proc(f"router_{policy}", argv, log_dir))
            routers.append((policy, f"http://127.0.0.1:{port}"))
        for p, (_, url) in zip(procs[3:], routers, strict=True):
            p.wait(url, timeout_s=120)
        sys.path.insert(0, str(REPO / "bench"))
        import serving

        print(f"logs: {log_dir}", flush=True)
        out_file = log_dir / "serving.json"
        rc = serving.main([
            "--output-file", str(out_file),
            "--compare", *(f"{policy}={url}" for policy, url in routers), "--rounds", str(args.rounds),
            "--tokenizer", model, "--dataset", "skewed", "--num-prompts", str(args.num_prompts),
            "--gsp-system-prompt-len", str(args.prefix_len), "--gsp-question-len", "32",
            "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
            "--random-range-ratio", "0.25", "--request-rate", str(args.request_rate),
            "--slo-ttft-ms", str(args.slo_ttft_ms), "--disable-tqdm", "--warmup-requests", "2",
        ])
        if rc != 0:
            return rc
        result = json.loads(out_file.read_text())["result"]
        names = {url: name for (url, _), name in zip(prefills, ("fast", "slow"), strict=True)}
        for policy, url in routers:  # where each policy sent the prompts
            workers = httpx.get(url + "/workers", timeout=10).json()["workers"]
            sent = {names[w["url"]]: w["total_requests"] for w in workers if w["url"] in names}
            result[policy]["prefill_requests"] = sent
            print(f"{policy}: prefill requests {sent}")
        print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; slow prefill: +{args.slow_step_s:g} s per forward")
        print("RESULT " + json.dumps(result))
        return 0
    finally:
        for p in reversed(procs):
            p.stop()


if __name__ == "__main__":
    sys.exit(main())
