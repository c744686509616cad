"""Summary statistics of one benchmark run (bench/serving.py).

Latency statistics cover successful requests only (ITL pools every gap of every successful
request); failures are counted in `failed` and listed with their error. Throughputs divide by
the run's duration. Goodput: successful requests per second with TTFT <= --slo-ttft-ms and
TPOT <= --slo-tpot-ms (an SLO not given always holds; a one-token request has no TPOT and
meets any TPOT SLO).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
from serving_client import RequestRecord

RESULT_KEYS = ("completed", "failed", "request_throughput", "output_throughput", "ttft_p50_ms", "ttft_p99_ms",
               "tpot_p50_ms", "tpot_p99_ms", "itl_p50_ms", "e2e_p50_ms", "goodput")
Result = dict[str, float | int | str | None]  # RESULT_KEYS -> value (None: no sample); failed_reasons


@dataclass(frozen=True)
class Slo:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met(self, r: RequestRecord) -> bool:
        if not r.success:
            return False
        if self.ttft_ms is not None and r.ttft * 1e3 > self.ttft_ms:
            return False
        tpot = r.tpot
        return self.tpot_ms is None or tpot is None or tpot * 1e3 <= self.tpot_ms


@dataclass(frozen=True)
class Stats:
    """Milliseconds; None when there is no sample."""

    mean: float | None
    median: float | None
    p90: float | None
    p99: float | None
    n: int

    @staticmethod
    def of(seconds: Sequence[float]) -> Stats:
        if not seconds:
            return Stats(None, None, None, None, 0)
        a = np.asarray(seconds, dtype=np.float64) * 1e3
        p50, p90, p99 = (float(x) for x in np.percentile(a, [50, 90, 99]))
        return Stats(float(a.mean()), p50, p90, p99, len(a))


@dataclass(frozen=True)
class Summary:
    duration_s: float
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_throughput: float
    goodput: float
    good_requests: int
    ttft: Stats
    tpot: Stats
    itl: Stats
    e2e: Stats
    errors: dict[str, int]  # error text (first 120 chars) -> count

    def result(self) -> Result:
        """The RESULT-line keys."""
        flat: Result = {
            "completed": self.completed, "failed": self.failed,
            "request_throughput": self.request_throughput, "output_throughput": self.output_throughput,
            "ttft_p50_ms": self.ttft.median, "ttft_p99_ms": self.ttft.p99, "tpot_p50_ms": self.tpot.median,
            "tpot_p99_ms": self.tpot.p99, "itl_p50_ms": self.itl.median, "e2e_p50_ms": self.e2e.median,
            "goodput": self.goodput,
        }
        out: Result = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in flat.items()}
        if self.errors:  # a RESULT line read alone (CI, the GPU bundle) still says why requests failed
            out["failed_reasons"] = "; ".join(f"{n} x {err}" for err, n in list(self.errors.items())[:3])
        return out

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def summarize(records: Sequence[RequestRecord], duration: float, slo: Slo) -> Summary:
    ok = [r for r in records if r.success]
    dur = max(duration, 1e-9)
    n_in = sum(r.prompt_tokens if r.prompt_tokens is not None else r.input_len for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    good = sum(1 for r in ok if slo.met(r))
    errors = Counter(r.error[:120] for r in records if not r.success)
    return Summary(
        duration_s=duration, completed=len(ok), failed=len(records) - len(ok),
        total_input_tokens=n_in, total_output_tokens=n_out,
        request_throughput=len(ok) / dur, input_throughput=n_in / dur, output_throughput=n_out / dur,
        total_throughput=(n_in + n_out) / dur, goodput=good / dur, good_requests=good,
        ttft=Stats.of([r.ttft for r in ok]),
        tpot=Stats.of([t for r in ok if (t := r.tpot) is not None]),
        itl=Stats.of([g for r in ok for g in r.itl]),
        e2e=Stats.of([r.e2e for r in ok]),
        errors=dict(errors.most_common()),
    )


def throughput_timeline(records: Sequence[RequestRecord], bucket_s: float = 1.0) -> list[float]:
    """Output tokens received per second in consecutive buckets from t0 to the last finish (successes).

    A request's tokens are spread evenly over its content events (usage arrives only at the end).
    """
    ok = [r for r in records if r.success and r.output_tokens > 0]
    if not ok:
        return []
    end = max(r.start + r.e2e for r in ok)
    out = [0.0] * max(1, math.ceil(end / bucket_s))
    for r in ok:
        times = r.chunk_times
        per_event = r.output_tokens / len(times)
        for t in times:
            out[min(len(out) - 1, int(t / bucket_s))] += per_event
    last_width = max(end - (len(out) - 1) * bucket_s, 1e-3)  # the final bucket is usually partial
    return [x / bucket_s for x in out[:-1]] + [out[-1] / min(bucket_s, last_width)]


def ratios(first: Result, second: Result) -> dict[str, float | None]:
    """`<key>_ratio` = first / second for the throughput and latency RESULT keys (None where undefined)."""
    out: dict[str, float | None] = {}
    for k in RESULT_KEYS[2:]:
        a, b = first.get(k), second.get(k)
        out[f"{k}_ratio"] = round(a / b, 4) if a is not None and b else None
    return out
