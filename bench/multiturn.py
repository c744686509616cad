"""Multi-turn chats through 1P1D: plain PD against decode's prefix cache, same workload, same ports.

    python bench/multiturn.py [--model-path DIR] [--sessions 8] [--turns 4] [--system-len 512]
                              [--question-len 48] [--output-len 32] [--max-concurrency 4] [--quick]

Each session is a shared system prompt + per-turn questions; turn k's prompt is turn k-1's
prompt + its answer + a new question (token ids through the router's native /generate, greedy,
ignore_eos). Two runs on the same ports, pd.sh restarted in between:
  plain   launch/pd.sh as is
  cached  decode with --disaggregation-decode-enable-radix-cache: decode keeps each turn's KV,
          prefill sends only the pages decode lacks, and the router (following decode's KV
          events) sends a turn whose uncached suffix is at most decode's
          --disaggregation-local-prefill-max-tokens (default 256) to decode alone
Every request carries its session in x-session-id (session affinity; moot with one decode).
KV bytes come from prefill's /metrics (pdserve_kv_transfer_bytes), TTFT from the stream.
Both runs' answers must be identical (greedy): the bench fails otherwise.
Last line: RESULT {"ttft_p50_turn2plus_ratio", "kv_bytes_ratio", "local_prefill_fraction",
"tokens_per_s_ratio", ...}: cached / plain; local_prefill_fraction is the cached run's share
of turns prefilled on decode alone.
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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]


@dataclass
class TurnRecord:
    session: int
    turn: int
    prompt_len: int
    ttft_s: float
    output_ids: list[int]


@dataclass
class RunResult:
    label: str
    records: list[TurnRecord] = field(default_factory=list)
    duration_s: float = 0.0
    kv_bytes: float = 0.0
    local_prefills: float = 0.0

    def ttft_p50_turn2plus_ms(self) -> float:
        return 1e3 * statistics.median(r.ttft_s for r in self.records if r.turn >= 1)

    def tokens_per_s(self) -> float:
        return sum(len(r.output_ids) for r in self.records) / self.duration_s


class PDLaunch:
    """launch/pd.sh in its own process group; stopped with SIGTERM (it stops every role)."""

    def __init__(self, port: int, model_path: str | None, decode_args: str, log_dir: Path, dtype: str) -> None:
        argv = ["bash", str(REPO / "launch" / "pd.sh"), "--port", str(port), "--prefill-port", str(port + 100),
                "--decode-port", str(port + 200), "--bootstrap-port", str(port + 300), "--log-dir", str(log_dir),
                "--dtype", dtype]
        if model_path:
            argv += ["--model-path", model_path]
        if decode_args:
            argv += ["--decode-args", decode_args]
        self.url = f"http://127.0.0.1:{port}"
        self.prefill_url = f"http://127.0.0.1:{port + 100}"
        self.decode_url = f"http://127.0.0.1:{port + 200}"
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if "READY" in line:
                return
            if time.monotonic() > deadline:
                break
        raise SystemExit(f"pd.sh did not get ready (exit {self.proc.poll()})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10.0).text.splitlines():
        if line.startswith(f"pdserve_{name} "):
            return float(line.split()[1])
    return 0.0


async def one_turn(client: httpx.AsyncClient, url: str, prompt: list[int], max_new: int,
                   session: str) -> tuple[float, list[int]]:
    body = {"input_ids": prompt, "stream": True, "incremental_stream": True,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
    t0 = time.perf_counter()
    ttft: float | None = None
    events: list[list[int]] = []
    async with client.stream("POST", url + "/generate", json=body, headers={"x-session-id": session}) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            ids = event.get("output_ids") or []
            if ids and ttft is None:
                ttft = time.perf_counter() - t0
            events.append(ids)
    deltas = [t for ids in events for t in ids]
    answer = deltas if len(deltas) == max_new else (events[-1] if events else [])  # delta or cumulative stream
    if len(answer) != max_new or ttft is None:
        raise RuntimeError(f"answer of {len(answer)} tokens, wanted {max_new}")
    return ttft, answer


async def run_sessions(url: str, args: argparse.Namespace) -> tuple[list[TurnRecord], float]:
    rng = random.Random(args.seed)
    system = [rng.randrange(100, 20000) for _ in range(args.system_len)]
    questions = [[[rng.randrange(100, 20000) for _ in range(args.question_len)] for _ in range(args.turns)]
                 for _ in range(args.sessions)]
    slots = asyncio.Semaphore(args.max_concurrency)
    records: list[TurnRecord] = []

    async def session(s: int, client: httpx.AsyncClient) -> None:
        prompt = list(system)
        for k in range(args.turns):
            prompt = prompt + questions[s][k]
            async with slots:
                ttft, answer = await one_turn(client, url, prompt, args.output_len, f"session-{s}")
            records.append(TurnRecord(s, k, len(prompt), ttft, answer))
            prompt = prompt + answer

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=args.request_timeout) as client:
        await asyncio.gather(*(session(s, client) for s in range(args.sessions)))
    return sorted(records, key=lambda r: (r.session, r.turn)), time.perf_counter() - t0


def run_config(label: str, decode_args: str, args: argparse.Namespace, log_root: Path) -> RunResult:
    pd = PDLaunch(args.port, args.model_path, decode_args, log_root / label, args.dtype)
    try:
        pd.wait_ready()
        before = metric(pd.prefill_url, "kv_transfer_bytes")
        local_before = metric(pd.decode_url, "num_local_prefill_total")
        records, duration = asyncio.run(run_sessions(pd.url, args))
        time.sleep(1.0)  # the last transfers' acks
        kv = metric(pd.prefill_url, "kv_transfer_bytes") - before
        local = metric(pd.decode_url, "num_local_prefill_total") - local_before
    finally:
        pd.stop()
    return RunResult(label, records, duration, kv, local)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: the project's default model")
    p.add_argument("--dtype", default="auto", help="passed to pd.sh (auto: bf16 only where the CPU has it)")
    p.add_argument("--port", type=int, default=32000, help="router port; roles at +100, +200, +300")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--question-len", type=int, default=48)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-concurrency", type=int, default=4)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="4 sessions x 3 turns, 256-token system prompt")
    p.add_argument("--log-dir", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.sessions, args.turns, args.system_len = 4, 3, 256
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log_root = Path(args.log_dir or f"logs/multiturn-{int(time.time())}")
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "unknown")
    runs = [run_config("plain", "", args, log_root),
            run_config("cached", "--disaggregation-decode-enable-radix-cache", args, log_root)]
    plain, cached = runs
    same = sum(a.output_ids == b.output_ids for a, b in zip(plain.records, cached.records, strict=True))
    if same != len(plain.records):
        # Turns prefilled on decode compute their suffix in other batch shapes than prefill does: in
        # bf16 that can flip a near-tied greedy token; in fp32 every answer must match.
        print(f"{'error' if args.dtype == 'float32' else 'note'}: {len(plain.records) - same} of "
              f"{len(plain.records)} greedy answers differ between plain PD and the cached run", file=sys.stderr)
        if args.dtype == "float32":
            return 1
    print(f"CPU: {cpu}; {args.sessions} sessions x {args.turns} turns, system {args.system_len}, "
          f"question {args.question_len}, output {args.output_len}, concurrency {args.max_concurrency}")
    print(f"{'run':8} {'ttft p50 turn2+ ms':>19} {'kv MiB':>8} {'tok/s':>7} {'wall s':>7}")
    for r in runs:
        print(f"{r.label:8} {r.ttft_p50_turn2plus_ms():19.1f} {r.kv_bytes / 2**20:8.2f} {r.tokens_per_s():7.2f} "
              f"{r.duration_s:7.1f}")
    result: dict[str, Any] = {
        "ttft_p50_turn2plus_ratio": round(cached.ttft_p50_turn2plus_ms() / plain.ttft_p50_turn2plus_ms(), 3),
        "kv_bytes_ratio": round(cached.kv_bytes / plain.kv_bytes, 3) if plain.kv_bytes else None,
        "local_prefill_fraction": round(cached.local_prefills / len(cached.records), 3),
        "tokens_per_s_ratio": round(cached.tokens_per_s() / plain.tokens_per_s(), 3),
        "ttft_p50_turn2plus_ms": {r.label: round(r.ttft_p50_turn2plus_ms(), 1) for r in runs},
        "kv_bytes": {r.label: r.kv_bytes for r in runs},
        "answers_equal_fraction": round(same / len(plain.records), 3),
        "dtype": args.dtype,
        "cpu": cpu,
    }
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
