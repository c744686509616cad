"""--tp-size 2 (and 4) in the colocated engine: rank 0 here plus spawned rank processes, gloo on CPU.

Greedy output equals transformers (and so TP 1, which tests/engine pins there) on three
checkpoints: KV heads split (4 -> 2 per rank, qwen3's q/k norms; llama's 2 -> 1 per rank) and
replicated (qwen2, 1 KV head on both ranks, qkv bias, tied embeddings so the vocab-parallel
logits come from the embedding shard); TP 4 gives each rank one of qwen3's 4 KV heads. Prompts longer than a chunk prefill in pieces; a
second round hits the radix cache; the overlap loop runs the steps.
"""

from __future__ import annotations

import glob
import os
import random
import tempfile
from collections.abc import Callable, Iterator

import pytest

from common.engine import Engine
from tests.engine.test_engine_parity import check_parity, workload

CHECKPOINTS = {  # name: (arch, checkpoint overrides, TP size)
    "qwen3-kv4": ("qwen3", {"num_kv_heads": 4}, 2),
    "llama-kv2": ("llama", {}, 2),
    "qwen2-kv1-tied": ("qwen2", {"num_kv_heads": 1, "tie_word_embeddings": True}, 2),
    "qwen3-kv4-tp4": ("qwen3", {"num_kv_heads": 4}, 4),  # one KV head a rank, one torch thread each here
}


@pytest.fixture(scope="module", params=list(CHECKPOINTS), ids=list(CHECKPOINTS))
def tp_engine(request: pytest.FixtureRequest, tiny_checkpoint: Callable[..., str]) -> Iterator[tuple[Engine, str]]:
    arch, overrides, tp_size = CHECKPOINTS[request.param]
    path = tiny_checkpoint(arch, **overrides)
    engine = Engine(path, dtype="float32", page_size=4, chunked_prefill_size=32, max_prefill_tokens=96,
                    max_total_tokens=4096, tp_size=tp_size)
    try:
        yield engine, path
    finally:
        engine.shutdown()


def test_tp_greedy_equals_transformers(tp_engine: tuple[Engine, str]) -> None:
    engine, path = tp_engine
    kv_heads = engine.core.model_config.num_kv_heads
    assert engine.core.tp_ranks is not None and engine.core.tp_ranks.dead_reason() is None
    tp_size = engine.core.tp_ranks.size
    assert engine.core.kv_pool.num_kv_heads == max(1, kv_heads // tp_size)
    # the ranks' meeting files (store, KV pool mappings) are gone once everyone joined; what is
    # left is their private directory (0700) with the step sockets, removed at shutdown
    assert glob.glob(f"/dev/shm/pdserve_tp_{os.getpid()}_*") == []
    assert glob.glob(f"{tempfile.gettempdir()}/pdserve_tp_{os.getpid()}_*") == [engine.core.tp_ranks.addrs.dir]
    assert sorted(os.listdir(engine.core.tp_ranks.addrs.dir)) == [f"rank{r}" for r in range(1, tp_size)]
    rng = random.Random(5)
    shared = [rng.randrange(3, engine.vocab_size) for _ in range(40)]
    first = workload(engine.vocab_size, 6, seed=2, shared=shared)
    check_parity(engine, path, first, 10)
    outs = check_parity(engine, path, [p + [5, 6, 7] for p in first[:3]], 6)
    assert sum(o["meta_info"]["cached_tokens"] for o in outs) > 0

