"""Constrained greedy decoding on a GPU: the engine on CUDA (fp32, torch attention) against the
offline reference (transformers + xgrammar's own matcher, CPU), every constraint kind in one
mixed batch with an unconstrained row, in the normal and the overlap loop.

    python bench/gpu_grammar.py [DIR]     (DIR: where the tiny checkpoint goes; default a tmp dir)

Last line: RESULT {"device", "rows", "identical", "loops"}.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.grammar.reference: the reference

from common.engine import Engine
from common.model.testing import build_tiny_checkpoint
from tests.grammar.reference import CONSTRAINTS, constrained_greedy

MAX_NEW = 40


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="pdserve-grammar-")
    build_tiny_checkpoint(path, "llama")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rng = random.Random(3)
    kinds = [*CONSTRAINTS, None]
    rows = identical = 0
    for loop in ("normal", "overlap"):
        engine = Engine(path, device=device, dtype="float32", attention_backend="torch", page_size=16,
                        max_total_tokens=4096, disable_overlap_schedule=loop == "normal")
        try:
            batch = [[rng.randrange(3, engine.vocab_size) for _ in range(rng.choice([3, 9, 18]))] for _ in range(8)]
            params = [{"max_new_tokens": MAX_NEW, "temperature": 0.0,
                       **({kinds[i % 4]: CONSTRAINTS[kinds[i % 4]]} if kinds[i % 4] else {})} for i in range(8)]
            outs = engine.generate(input_ids=batch, sampling_params=params)
            for i, (prompt, out) in enumerate(zip(batch, outs, strict=True)):
                kind = kinds[i % 4]
                if kind is None:
                    continue
                rows += 1
                same = out["output_ids"] == constrained_greedy(path, prompt, kind, CONSTRAINTS[kind], MAX_NEW)
                identical += same
                print(f"{loop} row {i} {kind}: {'identical' if same else 'DIVERGED'}", flush=True)
            engine.check_integrity()
        finally:
            engine.shutdown()
    print("RESULT " + json.dumps({"device": device, "rows": rows, "identical": identical, "loops": 2}))


if __name__ == "__main__":
    main()
