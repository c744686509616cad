"""Prometheus metrics of one instance, served by its frontend at GET /metrics.

Frontend-measured: request counts by HTTP status, finish reasons, token counts,
TTFT / inter-token / end-to-end latency histograms. Engine-reported: every key
of the latest StatsResp becomes a gauge `pdserve_<key>` (queue sizes, running
batch size, KV usage, cache hit rate, new_token_ratio, retractions, ...).
Each FrontendMetrics owns its own registry, so several instances can live in
one process (tests).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
_BAD_CHARS = re.compile(r"[^a-zA-Z0-9_]")


def engine_metric_name(key: str, reserved: frozenset[str] = frozenset()) -> str:
    """`pdserve_<key>`, or `pdserve_engine_<key>` where that would clash with a frontend metric."""
    name = "pdserve_" + _BAD_CHARS.sub("_", key)
    return "pdserve_engine_" + name.removeprefix("pdserve_") if name in reserved else name


class EngineStatsCollector(Collector):
    """Exposes the engine's latest stats dict, one gauge per key."""

    def __init__(self) -> None:
        self.stats: dict[str, float] = {}
        self.up = False
        self.reserved: frozenset[str] = frozenset()  # sample names the frontend's own metrics use

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "pdserve_engine_up", "1 when the engine answered the last stats probe", self.up
        )
        for key, value in sorted(self.stats.items()):
            yield GaugeMetricFamily(engine_metric_name(key, self.reserved), f"engine stat {key}", value)


class FrontendMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "pdserve_requests", "finished /generate requests by HTTP status", ["status"], registry=r
        )
        self.finish_reasons = Counter(
            "pdserve_finish_reasons", "requests that finished normally, by reason", ["reason"], registry=r
        )
        self.prompt_tokens = Counter(
            "pdserve_prompt_tokens", "prompt tokens of accepted requests", registry=r
        )
        self.generation_tokens = Counter(
            "pdserve_generation_tokens", "tokens streamed to clients", registry=r
        )
        self.in_flight = Gauge("pdserve_frontend_in_flight_requests", "requests in the frontend", registry=r)
        self.rejected_full = Counter(
            "pdserve_rejected_full", "requests refused with 503 (--max-queued-requests reached)", registry=r
        )
        self.stats_requests = Counter(
            "pdserve_engine_stats_requests", "StatsReq messages sent to the engine (one in flight at most)", registry=r
        )
        self.stream_cut_off = Counter(
            "pdserve_stream_cut_off", "streams aborted because the client did not read", registry=r
        )
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds",
            "arrival to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pdserve_inter_token_latency_seconds", "gap between tokens", buckets=_ITL_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "pdserve_e2e_request_latency_seconds",
            "arrival to last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.engine = EngineStatsCollector()
        self.engine.reserved = frozenset(
            name for metric in r.collect() for name in (metric.name, *(s.name for s in metric.samples))
        )
        r.register(self.engine)

    def render(self) -> bytes:
        return generate_latest(self.registry)
