"""Summary statistics of bench/serving.py on hand-made records (known answers)."""

from __future__ import annotations

import pytest
from serving_client import RequestRecord
from serving_metrics import RESULT_KEYS, Slo, Stats, ratios, summarize, throughput_timeline


def rec(i: int, ttft: float, itl: list[float], e2e: float, out: int, *, start: float = 0.0,
        error: str = "", prompt: int | None = None) -> RequestRecord:
    return RequestRecord(i, 10, out, success=not error, error=error, start=start, ttft=ttft, e2e=e2e, itl=itl,
                         output_tokens=out, prompt_tokens=prompt)


def test_tpot_and_chunk_times() -> None:
    r = rec(0, 0.1, [0.02, 0.03], 0.2, 5, start=1.0)
    assert r.tpot == pytest.approx(0.1 / 4)
    assert r.chunk_times == pytest.approx([1.1, 1.12, 1.15])
    assert rec(1, 0.1, [], 0.1, 1).tpot is None


def test_summary_counts_failures_and_goodput() -> None:
    records = [
        rec(0, 0.010, [0.005] * 3, 0.040, 4, prompt=7),   # tpot 10 ms
        rec(1, 0.030, [0.010] * 3, 0.090, 4),              # tpot 20 ms
        rec(2, 0.020, [], 0.020, 1),                       # one token: no TPOT
        rec(3, 0.0, [], 0.5, 0, error="HTTP 500: boom"),
        rec(4, 0.0, [], 0.5, 0, error="HTTP 500: boom"),
    ]
    s = summarize(records, 2.0, Slo(ttft_ms=25.0, tpot_ms=15.0))
    assert (s.completed, s.failed) == (3, 2)
    assert s.errors == {"HTTP 500: boom": 2}
    assert s.total_input_tokens == 7 + 10 + 10 and s.total_output_tokens == 9
    assert s.request_throughput == pytest.approx(1.5) and s.output_throughput == pytest.approx(4.5)
    assert s.total_throughput == pytest.approx((27 + 9) / 2)
    assert s.good_requests == 2 and s.goodput == pytest.approx(1.0)  # rec 1 misses both SLOs
    assert s.ttft.n == 3 and s.ttft.median == pytest.approx(20.0) and s.ttft.mean == pytest.approx(20.0)
    assert s.tpot.n == 2 and s.tpot.mean == pytest.approx(15.0)
    assert s.itl.n == 6 and s.itl.median == pytest.approx(7.5)
    assert s.e2e.p99 == pytest.approx(89.0)  # 40 + 0.98 * (90 - 40)
    assert summarize(records, 2.0, Slo()).good_requests == 3
    res = s.result()
    assert set(res) == {*RESULT_KEYS, "failed_reasons"} and res["failed_reasons"] == "2 x HTTP 500: boom"
    assert res["failed"] == 2 and res["tpot_p50_ms"] == pytest.approx(15.0)


def test_empty_run_has_no_latencies() -> None:
    s = summarize([rec(0, 0, [], 1.0, 0, error="empty output")], 1.0, Slo(ttft_ms=1.0))
    assert (s.completed, s.failed, s.goodput) == (0, 1, 0.0)
    assert s.ttft == Stats(None, None, None, None, 0)
    assert s.result()["ttft_p50_ms"] is None
    assert throughput_timeline([]) == []


def test_throughput_timeline_buckets_sum_to_tokens() -> None:
    # 4 tokens over events at 0.5, 1.5, 2.5, 2.75 s; the last bucket ends at 2.8 s (0.8 s wide)
    a = rec(0, 0.5, [1.0, 1.0, 0.25], 2.8, 4)
    b = rec(1, 0.2, [], 0.3, 1, start=0.1)
    fail = rec(2, 0.1, [0.1], 5.0, 3, error="stream error: x")
    tl = throughput_timeline([a, b, fail])
    assert tl == pytest.approx([2.0, 1.0, 2.0 / 0.8])


def test_ratios_first_over_second() -> None:
    r = ratios({"ttft_p50_ms": 10.0, "goodput": 0.0, "completed": 5}, {"ttft_p50_ms": 40.0, "goodput": 0.0})
    assert r["ttft_p50_ms_ratio"] == 0.25 and r["goodput_ratio"] is None and "completed_ratio" not in r
