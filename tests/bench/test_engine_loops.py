"""bench/engine_loops.py: each loop's engine in its own process, driven over stdin (tiny model)."""

from __future__ import annotations

import bench_fakes  # noqa: F401  (puts bench/ on sys.path)
from engine_loops import LOOPS, LoopChild


def test_each_loop_runs_steady_decode_in_its_own_process(tiny_llama_path: str) -> None:
    children = [LoopChild(loop, model_path=tiny_llama_path, dtype="float32", batch=4) for loop in LOOPS]
    try:
        for child in children:
            assert child.run(4, 3) > 0
            assert child.run(2, 2) > 0
    finally:
        for child in children:
            child.close()
    assert [c.proc.returncode for c in children] == [0, 0]
