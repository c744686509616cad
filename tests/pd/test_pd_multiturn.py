"""Multi-turn chats through a real prefill and a decode with --disaggregation-decode-enable-radix-cache
(real processes, real NIXL, tiny model, fp32, overlap loop on decode): every turn's tokens equal
transformers' on the same full prompt, while a 256-token decode pool forces both retraction
(four sessions decoding at once do not fit) and eviction of earlier turns from decode's tree.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.engine.reference import hf_greedy
from tests.pd.pd_procs import PDPair, start_pair

VOCAB = 384


@pytest.fixture(scope="module")
def cached_pair(tiny_llama_path: str) -> Iterator[PDPair]:
    p = start_pair(
        Path(tiny_llama_path),
        ["--page-size", "4", "--chunked-prefill-size", "32", "--max-total-tokens", "8192"],
        ["--page-size", "4", "--max-total-tokens", "256", "--num-reserved-decode-tokens", "0",
         "--schedule-conservativeness", "0.3", "--enable-cpu-overlap-schedule",
         "--disaggregation-decode-enable-radix-cache"],
    )
    try:
        yield p
    finally:
        p.stop()


def test_sessions_of_four_turns_equal_transformers(cached_pair: PDPair, tiny_llama_path: str) -> None:
    info = httpx.get(cached_pair.decode.url + "/server_info", timeout=10.0).json()
    assert info["radix_cache"] is True
    rng = random.Random(11)
    sessions = [[rng.randrange(3, VOCAB) for _ in range(30)] for _ in range(4)]
    for turn in range(4):
        results = cached_pair.run([cached_pair.body(prompt, 40) for prompt in sessions])
        for i, (prompt, res) in enumerate(zip(sessions, results, strict=True)):
            assert res.error is None, (turn, i, res.error)
            assert res.output_ids == hf_greedy(tiny_llama_path, prompt, 40), (turn, i)
            sessions[i] = prompt + res.output_ids + [rng.randrange(3, VOCAB) for _ in range(6)]
    decode = cached_pair.decode
    assert (decode.stat("num_retractions_total") or 0) > 0, "four sessions at once were meant to overflow the pool"
    assert (decode.stat("kv_pages_evicted_total") or 0) > 0, "earlier turns were meant to be evicted"
    # Which of those turns found their prefix still cached depends on the interleaving; a short
    # conversation alone must: nothing runs between its turns, and LRU eviction takes older pages.
    from_cache = decode.stat("kv_pages_from_cache_total") or 0
    skipped = cached_pair.prefill.stat("kv_pages_skipped_total") or 0
    prompt = [rng.randrange(3, VOCAB) for _ in range(30)]
    for _ in range(2):
        (res,) = cached_pair.run([cached_pair.body(prompt, 8)])
        assert res.error is None and res.output_ids == hf_greedy(tiny_llama_path, prompt, 8)
        prompt = prompt + res.output_ids + [rng.randrange(3, VOCAB) for _ in range(6)]
    assert (decode.stat("kv_pages_from_cache_total") or 0) - from_cache == (30 + 8 - 1) // 4
    assert (cached_pair.prefill.stat("kv_pages_skipped_total") or 0) - skipped == (30 + 8 - 1) // 4
    cached_pair.wait_whole()
