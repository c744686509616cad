"""Decode's transfer deadline measures a stalled transfer, not a long prefill queue.

1 prefill + 1 decode, real processes, real NIXL, tiny model. Every prefill forward is made
1 s slower (--engine-fault-spec) and runs 16 tokens, so a burst keeps requests in prefill's
queue many times longer than decode's 3 s --disaggregation-transfer-timeout while prefill
stays alive: every request must complete, token for token as transformers. A SIGSTOPped
prefill sends no sign of life: decode must fail its requests within the transfer timeout
(the peer heartbeat timeout is set far longer, so the per-room deadline is what fires).
A prefill whose engine hangs (process alive) fails its rooms itself once the engine has left
them unpolled past --watchdog-timeout, so decode hears at once (second pair).
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine.reference import hf_greedy
from tests.harness.process import wait_until
from tests.pd.pd_procs import PDPair, PDResult, start_pair

pytestmark = pytest.mark.proc

VOCAB = 384
TRANSFER_TIMEOUT_S = 3.0
HB = ["--disaggregation-heartbeat-interval", "1", "--disaggregation-heartbeat-timeout", "30"]
FAILED_WITHIN_S = TRANSFER_TIMEOUT_S + 1.0 + 3.0  # + one ping interval + slack for a loaded 2-core box


@pytest.fixture(scope="module")
def pair(tiny_llama_path: str) -> Iterator[PDPair]:
    p = start_pair(Path(tiny_llama_path),
                   ["--page-size", "4", "--chunked-prefill-size", "16", "--max-prefill-tokens", "16",
                    "--max-total-tokens", "8192", "--engine-fault-spec", "slow_step_s=1.0,after_steps=0", *HB],
                   ["--page-size", "4", "--max-total-tokens", "8192",
                    "--disaggregation-transfer-timeout", str(TRANSFER_TIMEOUT_S), *HB])
    try:
        yield p
    finally:
        p.stop()


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(length)] for _ in range(n)]


def test_prefill_queue_longer_than_the_transfer_timeout_is_served(pair: PDPair, tiny_llama_path: str) -> None:
    failures = pair.decode.stat("num_transfer_failures_total")
    assert failures is not None
    batch = prompts(5, 48, seed=7)  # 15 slow forwards: the last request waits >= 12 s in prefill's queue
    t0 = time.monotonic()
    results = pair.run([pair.body(p, 6) for p in batch])
    waited = time.monotonic() - t0
    for prompt, res in zip(batch, results, strict=True):
        assert res.error is None and res.decode_status == 200 and res.prefill_status == 200, res
        assert res.output_ids == hf_greedy(tiny_llama_path, prompt, 6)
    assert waited > 3 * TRANSFER_TIMEOUT_S, f"the burst took {waited:.1f}s: the queue never outlived the timeout"
    assert pair.decode.stat("num_transfer_failures_total") == failures
    pair.wait_whole()


def test_stopped_prefill_still_fails_within_the_transfer_timeout(pair: PDPair, tiny_llama_path: str) -> None:
    batch = prompts(4, 48, seed=8)
    results: list[PDResult] = []
    runner = threading.Thread(target=lambda: results.extend(pair.run([pair.body(p, 6) for p in batch])))
    runner.start()
    try:
        assert wait_until(lambda: (pair.prefill.stat("num_waiting_reqs") or 0) >= 2, 30, period_s=0.05), \
            "the requests never queued on prefill"
        t_stop = time.monotonic()
        pair.prefill.child.signal_group(signal.SIGSTOP)
        try:  # decode holds nothing waiting for KV any more: each such request failed
            failed = wait_until(lambda: pair.decode.stat("num_transfer_queue_reqs") == 0, FAILED_WITHIN_S + 5, period_s=0.1)
            failed_after = time.monotonic() - t_stop
        finally:
            pair.prefill.child.signal_group(signal.SIGCONT)
        assert failed, "decode never failed the requests of a stopped prefill"
        assert failed_after <= FAILED_WITHIN_S, f"failed {failed_after:.1f}s after the stop"
    finally:
        runner.join(120)
    assert len(results) == len(batch)
    timed_out = [r for r in results if r.error is not None]
    assert len(timed_out) >= 2, results  # queued behind >= 2 slow forwards when prefill stopped
    for prompt, res in zip(batch, results, strict=True):
        if res.error is None:  # done before the stop
            assert res.output_ids == hf_greedy(tiny_llama_path, prompt, 6)
        else:
            assert res.error["type"] == "transfer_timeout" and "sign of life" in res.error["message"], res
    pair.wait_whole(timeout_s=40)


WATCHDOG_S = 2.0


@pytest.fixture(scope="module")
def hung_prefill_pair(tiny_llama_path: str) -> Iterator[PDPair]:
    """Prefill's first forward never returns; decode's transfer and heartbeat timeouts are long,
    so only prefill's own verdict on its hung engine can fail the rooms quickly."""
    p = start_pair(Path(tiny_llama_path),
                   ["--page-size", "4", "--max-total-tokens", "256", "--engine-fault-spec", "hang,after_steps=0",
                    "--watchdog-timeout", str(WATCHDOG_S), *HB],
                   ["--page-size", "4", "--max-total-tokens", "256", "--disaggregation-transfer-timeout", "120", *HB])
    try:
        yield p
    finally:
        p.stop()


def test_hung_prefill_engine_fails_its_rooms_within_the_watchdog_timeout(hung_prefill_pair: PDPair) -> None:
    pair = hung_prefill_pair
    t0 = time.monotonic()
    results = pair.run([pair.body(p, 6) for p in prompts(2, 24, seed=9)], timeout_s=60)
    took = time.monotonic() - t0
    for res in results:
        assert res.error is not None and res.error["type"] == "transfer_timeout", res
        assert "engine has not looked after this request" in res.error["message"], res
    # Before: prefill vouched for the rooms until max(heartbeat, transfer) timeout and decode failed
    # them only when the exiting instance's heartbeats stopped (30 s here) or its 120 s deadline.
    assert took < WATCHDOG_S + 10, f"decode failed the rooms {took:.1f}s after they were sent"
    assert wait_until(lambda: pair.decode.stat("num_transfer_queue_reqs") == 0
                      and pair.decode.stat("kv_pages_in_use") == 0 and pair.decode.stat("num_draining_reqs") == 0,
                      20, period_s=0.2), pair.decode.log()[-2000:]


BOOTSTRAP_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def queued_decode_pair(tiny_llama_path: str) -> Iterator[PDPair]:
    """Decode runs one request at a time, each step 0.5 s slower: a second request waits in its
    prealloc queue (no page ids sent) far longer than prefill's 3 s bootstrap timeout."""
    p = start_pair(Path(tiny_llama_path),
                   ["--page-size", "4", "--max-total-tokens", "256",
                    "--disaggregation-bootstrap-timeout", str(BOOTSTRAP_TIMEOUT_S), *HB],
                   ["--page-size", "4", "--max-total-tokens", "256", "--max-running-requests", "1",
                    "--engine-fault-spec", "slow_step_s=0.5,after_steps=0", *HB])
    try:
        yield p
    finally:
        p.stop()


def test_decode_prealloc_queue_longer_than_the_bootstrap_timeout_is_served(
    queued_decode_pair: PDPair, tiny_llama_path: str
) -> None:
    pair = queued_decode_pair
    batch = prompts(2, 24, seed=10)
    t0 = time.monotonic()
    results = pair.run([pair.body(p, 10) for p in batch], timeout_s=90)
    waited = time.monotonic() - t0
    for prompt, res in zip(batch, results, strict=True):
        assert res.error is None and res.decode_status == 200 and res.prefill_status == 200, res
        assert res.output_ids == hf_greedy(tiny_llama_path, prompt, 10)
    assert waited > 2 * BOOTSTRAP_TIMEOUT_S, f"took {waited:.1f}s: no request outwaited the bootstrap timeout"
    pair.wait_whole()
