"""Constrained greedy decoding: the engine's tokens == the offline reference's (transformers +
xgrammar's own matcher), for each constraint kind, page sizes 1 and 16, the normal loop, the
overlap loop with a worker thread (CPU) and on one thread (as on CUDA), and with retraction."""

from __future__ import annotations

import random

import pytest

from common.engine import Engine
from tests.grammar.reference import CONSTRAINTS, constrained_greedy

MAX_NEW = 40


def prompts(vocab: int, n: int, seed: int, length: int = 9) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.choice([3, length, 2 * length]))] for _ in range(n)]


def run_mixed(engine: Engine, path: str, batch: list[list[int]], max_new: int = MAX_NEW) -> list[dict]:
    """Every kind in one batch plus an unconstrained row: rows must not mix their masks."""
    kinds = [*CONSTRAINTS, None]
    params = []
    for i in range(len(batch)):
        kind = kinds[i % len(kinds)]
        p = {"max_new_tokens": max_new, "temperature": 0.0}
        if kind is not None:
            p[kind] = CONSTRAINTS[kind]
        params.append(p)
    outs = engine.generate(input_ids=batch, sampling_params=params)
    for i, (prompt, out) in enumerate(zip(batch, outs, strict=True)):
        kind = kinds[i % len(kinds)]
        if kind is None:
            continue
        want = constrained_greedy(path, prompt, kind, CONSTRAINTS[kind], max_new)
        assert out["output_ids"] == want, f"{kind} row {i} diverged"
        ended = want[-1] in engine.eos_token_ids
        assert out["meta_info"]["finish_reason"]["type"] == ("stop" if ended else "length")
    engine.check_integrity()
    return outs


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("loop", ["normal", "overlap", "one-thread"])
def test_constrained_parity(tiny_llama_path, page_size, loop):
    path = str(tiny_llama_path)
    engine = Engine(path, dtype="float32", page_size=page_size, chunked_prefill_size=16, max_total_tokens=4096,
                    disable_overlap_schedule=loop == "normal",
                    overlap_worker_thread="off" if loop == "one-thread" else "auto")
    try:
        outs = run_mixed(engine, path, prompts(engine.vocab_size, 8, seed=3))
        assert any(o["meta_info"]["finish_reason"]["type"] == "stop" for o in outs)  # some grammar ended
        stats = engine.scheduler.stats()
        assert stats["grammar_compiles_total"] == 3 and stats["grammar_cache_hits_total"] >= 3
    finally:
        engine.shutdown()


def test_constrained_parity_with_retraction(tiny_llama_path):
    """A pool too small for the batch: requests are retracted and re-prefilled mid-grammar; their
    matchers carry on from the tokens they already accepted."""
    path = str(tiny_llama_path)
    engine = Engine(path, dtype="float32", page_size=4, chunked_prefill_size=32, max_total_tokens=200,
                    schedule_policy="fcfs")
    try:
        run_mixed(engine, path, prompts(engine.vocab_size, 8, seed=11, length=12))
        assert engine.scheduler.num_retractions > 0
    finally:
        engine.shutdown()
