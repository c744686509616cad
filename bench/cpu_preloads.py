"""The CPU runtime preloads (common/cpu_runtime.py) measured back to back: glibc malloc + libgomp,
tcmalloc alone, Intel's OpenMP alone, both; each variant an engine in a process of its own (an
LD_PRELOAD holds for a whole process), rounds in rotated order so a noisy box hits all alike.

    python bench/cpu_preloads.py                      # default model, bf16, 3 rounds
    python bench/cpu_preloads.py --rounds 2 --model-path DIR

Per run: batch-1 decode tok/s (64 new), batch-16 decode tok/s (16 x 32 new), prefill tok/s (8 x
512 prompt tokens), each the best of two. Last line: RESULT {json} with each variant's geometric
mean and its ratio to the glibc/libgomp one. A variant whose library is not installed is left out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
from typing import Any

VARIANTS = {"none": (), "tcmalloc": ("tcmalloc",), "iomp5": ("iomp5",), "both": ("tcmalloc", "iomp5")}
METRICS = ("b1_tok_s", "bs16_tok_s", "prefill_tok_s")


def child(model_path: str | None, dtype: str) -> None:
    from engine_parts import run_engine

    from common.engine import Engine

    engine = Engine(model_path, dtype=dtype, page_size=16, chunked_prefill_size=512, max_prefill_tokens=4096,
                    max_running_requests=16, max_total_tokens=65536)
    rng = random.Random(0)
    vocab = min(40000, engine.core.model_config.vocab_size)

    def work(n: int, prompt: int, new: int) -> list[tuple[list[int], int]]:
        return [([rng.randrange(100, vocab) for _ in range(prompt)], new) for _ in range(n)]

    run_engine(engine, work(2, 32, 8))
    run_engine(engine, work(16, 64, 4))  # warm: both batch shapes
    out = {
        "b1_tok_s": max(64 / run_engine(engine, work(1, 64, 64)) for _ in range(2)),
        "bs16_tok_s": max(16 * 32 / run_engine(engine, work(16, 64, 32)) for _ in range(2)),
        "prefill_tok_s": max(8 * 512 / run_engine(engine, work(8, 512, 1)) for _ in range(2)),
    }
    print("CHILD " + json.dumps(out), flush=True)


def run_variant(libs: tuple[str, ...], paths: dict[str, str], args: argparse.Namespace) -> dict[str, float]:
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(paths[n] for n in libs)
    cmd = [sys.executable, __file__, "--child", "--dtype", args.dtype]
    if args.model_path:
        cmd += ["--model-path", args.model_path]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("CHILD "))
    return json.loads(line.removeprefix("CHILD "))  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.model_path, args.dtype)
        return
    from common.cpu_runtime import find_lib

    paths = {n: p for n in ("tcmalloc", "iomp5") if (p := find_lib(n)) is not None}
    names = [v for v, libs in VARIANTS.items() if all(n in paths for n in libs)]
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for v in order:
            res = run_variant(VARIANTS[v], paths, args)
            runs[v].append(res)
            print(f"round {r + 1} {v}: " + ", ".join(f"{k} {res[k]:.1f}" for k in METRICS), flush=True)
    result: dict[str, Any] = {"cpus": len(os.sched_getaffinity(0)), "rounds": args.rounds, "libs": paths}
    base = {k: _gmean([x[k] for x in runs["none"]]) for k in METRICS}
    for v in names:
        for k in METRICS:
            g = _gmean([x[k] for x in runs[v]])
            result[f"{v}_{k}"] = round(g, 1)
            result[f"{v}_{k.removesuffix('_tok_s')}_ratio"] = round(g / base[k], 3)
    print("RESULT " + json.dumps(result), flush=True)


def _gmean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


if __name__ == "__main__":
    main()
