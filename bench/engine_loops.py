"""The overlap loop vs the normal loop, each engine in a process of its own (bench/engine.py part 3).

Why separate processes: on CPU the overlap loop's worker thread must own the process's only
OpenMP pool (common/model/intra_op.py). A normal engine in the same process runs its forward
on the main thread, whose pool would throttle the overlap worker's. A server runs one loop per
engine process too, so this is also the honest comparison.

    parent                                   child (python bench/engine_loops.py --loop normal)
    LoopChild("normal"), LoopChild("overlap")   build the engine, warm up, print "ready"
    child.run(batch, steps)  ---- "32 64" --->  steady decode, print the seconds
    alternate A B A B (best of each)            ...  "" (EOF) -> shut down
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

from engine_parts import run_engine

from common.engine import Engine
from common.model.default_model import resolve_model_path

LOOPS = ("normal", "overlap")


def steady_work(batch: int, steps: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(1)
    return [([rng.randrange(100, vocab) for _ in range(64)], steps) for _ in range(batch)]


def loop_engine_args(loop: str, batch: int, dtype: str) -> dict[str, object]:
    if loop not in LOOPS:
        raise ValueError(f"loop must be one of {LOOPS}, got {loop!r}")
    return dict(
        dtype=dtype, page_size=16, chunked_prefill_size=512, max_prefill_tokens=4096, max_running_requests=batch,
        max_total_tokens=65536, disable_overlap_schedule=loop == "normal", enable_cpu_overlap_schedule=loop == "overlap",
    )


class LoopChild:
    """One engine with one loop in a child process, driven over its stdin/stdout."""

    def __init__(self, loop: str, *, model_path: str | None, dtype: str, batch: int) -> None:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--loop", loop, "--dtype", dtype, "--batch", str(batch)]
        if model_path:
            cmd += ["--model-path", model_path]
        self.loop = loop
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._expect("ready")

    def _expect(self, what: str) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.loop} loop child exited (rc {self.proc.wait()}) before {what}")
        return line

    def run(self, batch: int, steps: int) -> float:
        """Seconds of one steady decode of `batch` requests x `steps` tokens."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{batch} {steps}\n")
        self.proc.stdin.flush()
        return float(json.loads(self._expect("a result"))["seconds"])

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def child_main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--loop", choices=LOOPS, required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--model-path", default=None)
    args = ap.parse_args()
    engine = Engine(resolve_model_path(args.model_path), **loop_engine_args(args.loop, args.batch, args.dtype))
    run_engine(engine, steady_work(2, 4, engine.vocab_size))
    print("ready", flush=True)
    for line in sys.stdin:
        batch, steps = (int(x) for x in line.split())
        seconds = run_engine(engine, steady_work(batch, steps, engine.vocab_size))
        print(json.dumps({"seconds": seconds}), flush=True)
    engine.shutdown()


if __name__ == "__main__":
    child_main()
