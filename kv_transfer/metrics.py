"""Per-transfer metrics (prometheus_client) plus a plain stats dict for /metrics and tests.

Names carry a `phase` label ("prefill" | "decode"). Pass a CollectorRegistry to share one
with the engine's /metrics endpoint; the default is a private registry so that two
managers in one process never collide.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from kv_transfer.base import FailureCause

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_GBPS_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)


class TransferMetrics:
    def __init__(self, phase: str, registry: CollectorRegistry | None = None) -> None:
        self.phase = phase
        self.registry = registry if registry is not None else CollectorRegistry()
        self._lock = threading.Lock()
        self._bytes = Counter("kv_transfer_bytes", "KV+aux bytes moved", ["phase"], registry=self.registry)
        self._descs = Counter("kv_transfer_descriptors", "NIXL descriptors posted", ["phase"], registry=self.registry)
        self._transfers = Counter("kv_transfer_requests", "rooms transferred successfully", ["phase"], registry=self.registry)
        self._failures = Counter(
            "kv_transfer_failures", "rooms failed, by cause", ["phase", "cause"], registry=self.registry
        )
        self._latency = Histogram(
            "kv_transfer_latency_seconds",
            "first post (prefill) or init (decode) to Success",
            ["phase"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._gbps = Histogram(
            "kv_transfer_bandwidth_gbps", "per-room GB/s", ["phase"], buckets=_GBPS_BUCKETS, registry=self.registry
        )
        self._totals: dict[str, Any] = {"bytes": 0, "descriptors": 0, "transfers": 0, "busy_s": 0.0}
        self._failed: dict[str, int] = {}

    def posted(self, nbytes: int, ndescs: int) -> None:
        self._bytes.labels(self.phase).inc(nbytes)
        self._descs.labels(self.phase).inc(ndescs)
        with self._lock:
            self._totals["bytes"] += nbytes
            self._totals["descriptors"] += ndescs

    def completed(self, nbytes: int, latency_s: float) -> None:
        self._transfers.labels(self.phase).inc()
        self._latency.labels(self.phase).observe(latency_s)
        if latency_s > 0 and nbytes > 0:
            self._gbps.labels(self.phase).observe(nbytes / latency_s / 1e9)
        with self._lock:
            self._totals["transfers"] += 1
            self._totals["busy_s"] += latency_s
            if self.phase == "decode":
                self._totals["bytes"] += nbytes

    def failed(self, cause: FailureCause) -> None:
        self._failures.labels(self.phase, cause.value).inc()
        with self._lock:
            self._failed[cause.value] = self._failed.get(cause.value, 0) + 1

    def stats(self) -> dict[str, Any]:
        """{bytes, descriptors, transfers, failures: {cause: n}, gbps} (gbps over time spent transferring)."""
        with self._lock:
            out = dict(self._totals)
            out["failures"] = dict(self._failed)
        busy = out.pop("busy_s")
        out["gbps"] = out["bytes"] / busy / 1e9 if busy > 0 else 0.0
        return out
