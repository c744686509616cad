"""--disaggregation-decode-enable-radix-cache on real engines in this process (tiny model, fp32)
joined by real KVManagers: multi-turn greedy parity with transformers, and the exact bytes a
later turn moves (only the pages after the prefix decode holds, plus the aux row).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import pytest

from tests.engine.reference import hf_greedy
from tests.pd.inproc import InProcessPD

VOCAB = 384


@pytest.fixture
def cached_pd(tiny_llama_path: str) -> Iterator[InProcessPD]:
    pd = InProcessPD(tiny_llama_path, decode_args={"disaggregation_decode_enable_radix_cache": True})
    try:
        yield pd
    finally:
        pd.close()


def transferred_bytes(pd: InProcessPD) -> tuple[int, int]:
    """(prefill posted, decode received) KV + aux bytes so far, from the managers' metrics."""
    assert pd.prefill.transfer is not None and pd.decode.transfer is not None
    return (int(pd.prefill.transfer.service.stats()["bytes"]),  # type: ignore[attr-defined]
            int(pd.decode.transfer.service.stats()["bytes"]))  # type: ignore[attr-defined]


def test_multi_turn_chat_moves_only_new_pages_and_stays_exact(cached_pd: InProcessPD, tiny_llama_path: str) -> None:
    pd = cached_pd
    rng = random.Random(4)
    layout = pd.decode.kv_pool.layout
    page_bytes = layout.page_bytes  # one page: every layer's K and V
    row_bytes = 384
    ps = pd.decode.kv_pool.page_size
    prompt = [rng.randrange(3, VOCAB) for _ in range(30)]
    held = 0  # tokens of the conversation so far whose KV decode's tree holds (whole pages)
    for turn in range(4):
        rid = f"turn{turn}"
        before = transferred_bytes(pd)
        from_cache_before = pd.decode.scheduler.stats()["kv_pages_from_cache_total"]
        pd.submit(rid, prompt, 6)
        pd.run_until_finished([rid])
        answer = pd.tokens(rid)
        assert answer == hf_greedy(tiny_llama_path, prompt, 6), rid
        skipped = int(pd.decode.scheduler.stats()["kv_pages_from_cache_total"] - from_cache_before)
        # decode matches whole pages, and always leaves the prompt's last page to the transfer
        assert skipped == min(held, (len(prompt) - 1) // ps * ps) // ps, rid
        sent_pages = -(-len(prompt) // ps) - skipped
        after = transferred_bytes(pd)
        assert after[1] - before[1] == sent_pages * page_bytes + row_bytes, rid
        pd.settle()
        assert transferred_bytes(pd)[0] - before[0] == sent_pages * page_bytes + row_bytes, rid
        held = (len(prompt) + len(answer) - 1) // ps * ps  # the answer's last token has no KV yet
        prompt = prompt + answer + [rng.randrange(3, VOCAB) for _ in range(5 + turn)]
    assert skipped > 0
    pd.decode.scheduler.kv.check_integrity()
    assert pd.prefill.scheduler.stats()["kv_pages_skipped_total"] > 0


def test_abort_mid_suffix_transfer_keeps_both_trees_whole(cached_pd: InProcessPD, tiny_llama_path: str) -> None:
    pd = cached_pd
    rng = random.Random(7)
    first = [rng.randrange(3, VOCAB) for _ in range(40)]
    pd.submit("first", first, 4)
    pd.run_until_finished(["first"])
    second = first + pd.tokens("first") + [rng.randrange(3, VOCAB) for _ in range(9)]
    pd.submit("second", second, 4)
    deadline = time.monotonic() + 60.0
    while not any(r.rid == "second" for r in pd.decode.scheduler.transferring):  # decode handed its pages
        assert time.monotonic() < deadline, "decode never admitted the second turn"
        pd.decode.transfer.poll()  # type: ignore[union-attr]  (decode only: prefill must not finish it)
    assert pd.decode.scheduler.abort("second", "client left")
    pd.settle()
    pd.decode.scheduler.kv.check_integrity()
    pd.prefill.scheduler.kv.check_integrity()
    pd.submit("third", second, 4)  # the aborted suffix never entered the tree; the prefix still serves
    pd.run_until_finished(["third"])
    assert pd.tokens("third") == hf_greedy(tiny_llama_path, second, 4)


def test_a_short_new_turn_is_prefilled_on_decode(cached_pd: InProcessPD, tiny_llama_path: str) -> None:
    pd = cached_pd
    rng = random.Random(9)
    first = [rng.randrange(3, VOCAB) for _ in range(45)]
    pd.submit("first", first, 8)
    pd.run_until_finished(["first"])
    second = first + pd.tokens("first") + [rng.randrange(3, VOCAB) for _ in range(6)]
    before = transferred_bytes(pd)
    pd.submit_local("second", second, 8)
    pd.run_until_finished(["second"])
    assert pd.tokens("second") == hf_greedy(tiny_llama_path, second, 8)
    assert transferred_bytes(pd) == before  # no prefill, no transfer
    stats = pd.decode.scheduler.stats()
    assert stats["num_local_prefill_total"] == 1 and stats["num_local_prefill_cache_miss_total"] == 0
    assert pd.decode_out.outputs["second"][-1].cached_tokens == (45 + 8 - 1) // 4 * 4
