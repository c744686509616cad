"""Issue 23, item 9: decode's host copies of retracted requests have a byte budget
(--swap-space, GiB) and a metric. Real prefill and decode engines in this process (NIXL),
a decode pool too small for three requests so that decode must retract."""

from __future__ import annotations

import random

from tests.pd.inproc import InProcessPD

# 17 pages of 4 tokens: three requests of 12 prompt + 40 output tokens cannot all fit.
DECODE = {"max_total_tokens": 68, "num_reserved_decode_tokens": 1}
PROMPTS = {f"r{i}": [random.Random(i).randrange(5, 200) for _ in range(12)] for i in range(3)}


def run(pd: InProcessPD) -> int:
    """Submit the three, run them to the end; the most host-copy bytes decode held at once."""
    for rid, prompt in PROMPTS.items():
        pd.submit(rid, prompt, 40, ignore_eos=True)
    peak = 0
    sched = pd.decode.scheduler
    while not all(pd.decode_out.finished(r) for r in PROMPTS):
        pd._pump_or_wait()
        peak = max(peak, sched.host_kv_bytes)  # type: ignore[attr-defined]
    return peak


def test_swap_space_holds_host_copies_and_counts_them(tiny_llama_path: str) -> None:
    pd = InProcessPD(tiny_llama_path, decode_args={**DECODE, "swap_space": 1.0})
    try:
        peak = run(pd)
        sched = pd.decode.scheduler
        assert sched.num_retractions > 0, "the pool was meant to be too small for all three"
        assert peak > 0 and sched.host_kv_bytes == 0  # type: ignore[attr-defined]
        assert all(len(pd.tokens(r)) == 40 for r in PROMPTS)
        stats = sched.stats()
        assert stats["host_kv_bytes"] == 0 and stats["num_swap_space_refusals_total"] == 0
    finally:
        pd.close()


def test_a_retraction_past_swap_space_fails_that_request_clearly(tiny_llama_path: str) -> None:
    pd = InProcessPD(tiny_llama_path, decode_args={**DECODE, "swap_space": 0.0})
    try:
        peak = run(pd)
        sched = pd.decode.scheduler
        assert peak == 0 and sched.num_swap_space_refusals > 0  # type: ignore[attr-defined]
        ends = {r: pd.decode_out.outputs[r][-1].finish_reason for r in PROMPTS}
        refused = {r for r, f in ends.items() if f is not None and f.status_code == 503}
        assert refused and len(refused) < len(PROMPTS), ends
        for rid in refused:
            assert "--swap-space" in (ends[rid].message or ""), ends[rid]
        for rid in set(PROMPTS) - refused:
            assert len(pd.tokens(rid)) == 40
        assert sched.stats()["num_swap_space_refusals_total"] > 0
    finally:
        pd.close()
