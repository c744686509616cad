"""Router overhead against fast stub workers on loopback.

    python bench/router_overhead.py [--requests 400] [--duration 5] [--concurrency 32] [--tokens 8]

1. Added latency: sequential streamed requests, client -> router -> (stub P + stub D)
   versus client -> stub D directly (same tokens, same stub); p50/p99 of the
   difference of the two latency distributions' percentiles.
2. Max streamed throughput: closed-loop streamed /v1/completions requests from
   several client processes for --duration seconds; completed requests/s.

Everything (router, stubs, clients) shares this machine's cores, so the figures
are a lower bound for the router alone; router_cpu_ms_per_request (router process
CPU time / requests in step 2) is the machine-independent cost. Last line: RESULT {json}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "router")]

from router_procs import RouterProc, StubWorker, pd_args  # noqa: E402

from common.model.testing import build_tiny_checkpoint  # noqa: E402

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def stream_once(client: httpx.Client, url: str, body: dict[str, Any]) -> float:
    t0 = time.perf_counter()
    with client.stream("POST", url, json=body) as resp:
        assert resp.status_code == 200, resp.read()
        last = b""
        for chunk in resp.iter_raw():
            last = chunk
    assert last.endswith(b"data: [DONE]\n\n"), last[-100:]
    return time.perf_counter() - t0


def latency(router: RouterProc, decode: StubWorker, prefill: StubWorker, n: int, tokens: int) -> dict[str, float]:
    direct_body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": tokens}, "stream": True, "incremental_stream": True,
                   "bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.port + 1, "bootstrap_room": 1}
    routed_native = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": tokens}, "stream": True,
                     "incremental_stream": True}
    routed_openai = {"prompt": PROMPT, "max_tokens": tokens, "stream": True}
    out: dict[str, list[float]] = {"direct": [], "native": [], "openai": []}
    with httpx.Client(timeout=30) as c:
        for _ in range(20):  # warm up connections and code paths
            stream_once(c, decode.url + "/generate", direct_body)
            stream_once(c, router.url + "/v1/completions", routed_openai)
        for _ in range(n):  # interleaved, so drift in machine load hits all three alike
            out["direct"].append(stream_once(c, decode.url + "/generate", direct_body))
            out["native"].append(stream_once(c, router.url + "/generate", routed_native))
            out["openai"].append(stream_once(c, router.url + "/v1/completions", routed_openai))
    res = {}
    for k, xs in out.items():
        res[f"{k}_p50_ms"] = 1000 * statistics.median(xs)
        res[f"{k}_p99_ms"] = 1000 * pct(xs, 0.99)
    return res


async def _load(url: str, body: dict[str, Any], concurrency: int, duration: float) -> tuple[int, int]:
    ok = failed = 0
    stop = time.perf_counter() + duration
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=30, limits=limits) as c:

        async def worker() -> None:
            nonlocal ok, failed
            while time.perf_counter() < stop:
                try:
                    async with c.stream("POST", url, json=body) as resp:
                        async for _ in resp.aiter_raw():
                            pass
                    ok += resp.status_code == 200
                    failed += resp.status_code != 200
                except httpx.HTTPError:
                    failed += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ok, failed


def _load_proc(url: str, body: dict[str, Any], concurrency: int, duration: float, q: Any) -> None:
    q.put(asyncio.run(_load(url, body, concurrency, duration)))


def throughput(url: str, body: dict[str, Any], concurrency: int, duration: float, procs: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_load_proc, args=(url, body, concurrency // procs, duration, q)) for _ in range(procs)]
    t0 = time.perf_counter()
    for p in ps:
        p.start()
    results = [q.get(timeout=duration + 60) for _ in ps]
    for p in ps:
        p.join(timeout=10)
    elapsed = time.perf_counter() - t0 - 0.5  # process start-up is not load time (approximate)
    ok = sum(r[0] for r in results)
    return {"rps": ok / max(duration, 1e-9), "ok": ok, "failed": sum(r[1] for r in results),
            "wall_s": elapsed}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--client-procs", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=8)
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="router-bench-")
    model = build_tiny_checkpoint(Path(tmp) / "tiny", "llama")
    procs: list[Any] = []
    try:
        p, d = StubWorker("prefill", wait=False), StubWorker("decode", wait=False)
        procs += [p, d]
        router = RouterProc(model, pd_args([p], [d], "--health-check-interval", "1", "--log-level", "warning"),
                            wait=False)
        procs.append(router)
        for w in (p, d, router):
            w.wait_up()
        router.wait_ready()

        lat = latency(router, d, p, args.requests, args.tokens)
        for k in ("native", "openai"):
            print(f"{k:7s} p50 {lat[f'{k}_p50_ms']:.2f} ms  p99 {lat[f'{k}_p99_ms']:.2f} ms   "
                  f"direct p50 {lat['direct_p50_ms']:.2f} ms  p99 {lat['direct_p99_ms']:.2f} ms")
        body = {"prompt": PROMPT, "max_tokens": args.tokens, "stream": True}
        direct = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": args.tokens}, "stream": True, "incremental_stream": True,
                  "bootstrap_host": "127.0.0.1", "bootstrap_port": p.port + 1, "bootstrap_room": 1}
        thr_direct = throughput(d.url + "/generate", direct, args.concurrency, args.duration, args.client_procs)
        cpu0 = cpu_seconds(router.popen.pid)
        thr = throughput(router.url + "/v1/completions", body, args.concurrency, args.duration, args.client_procs)
        router_cpu_ms = 1000 * (cpu_seconds(router.popen.pid) - cpu0) / max(thr["ok"], 1)
        print(f"router CPU per streamed request: {router_cpu_ms:.2f} ms "
              f"(one core could serve ~{1000 / router_cpu_ms:.0f} req/s if the router had it to itself)")
        print(f"direct to stub: {thr_direct['rps']:.0f} req/s   through router: {thr['rps']:.0f} req/s "
              f"(failed {thr['failed']})")
        result = {
            "added_latency_p50_ms": round(lat["openai_p50_ms"] - lat["direct_p50_ms"], 3),
            "added_latency_p99_ms": round(lat["openai_p99_ms"] - lat["direct_p99_ms"], 3),
            "added_latency_native_p50_ms": round(lat["native_p50_ms"] - lat["direct_p50_ms"], 3),
            "max_streamed_rps": round(thr["rps"], 1),
            "direct_stub_streamed_rps": round(thr_direct["rps"], 1),
            "failed_requests": thr["failed"],
            "router_cpu_ms_per_request": round(router_cpu_ms, 3),
            "tokens_per_request": args.tokens,
            "concurrency": args.concurrency,
        }
    finally:
        for proc in reversed(procs):
            proc.stop()
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
