"""Per-transfer metrics (prometheus_client) plus a plain stats dict for /metrics and tests.

Names carry a `phase` label ("prefill" | "decode"). Pass a CollectorRegistry to share one
with the engine's /metrics endpoint; the default is a private registry so that two
managers in one process never collide.

Two clocks, kept apart so a bandwidth is a bandwidth:

    per WRITE handle (prefill)   post: building + posting its descriptors
                                 wire: posted -> NIXL says DONE (polled by the manager thread)
    per room                     latency: first post (prefill) or init (decode) -> Success;
                                 it includes the next chunk's compute and scheduler latency

GB/s (`gbps` in stats(), the kv_transfer_wire_gbps histogram) come from wire time only:
bytes of the KV handles / their post -> done seconds. The decode side sees no handles; its
gbps stays latency-based and says so in its help text.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from kv_transfer.base import FailureCause

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_POST_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)
_GBPS_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0)
_DESC_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)


class TransferMetrics:
    def __init__(self, phase: str, registry: CollectorRegistry | None = None) -> None:
        self.phase = phase
        self.registry = registry if registry is not None else CollectorRegistry()
        self._lock = threading.Lock()
        r = self.registry
        self._bytes = Counter("kv_transfer_bytes", "KV+aux bytes moved", ["phase"], registry=r)
        self._descs = Counter("kv_transfer_descriptors", "NIXL descriptors posted", ["phase"], registry=r)
        self._transfers = Counter("kv_transfer_requests", "rooms transferred successfully", ["phase"], registry=r)
        self._failures = Counter("kv_transfer_failures", "rooms failed, by cause", ["phase", "cause"], registry=r)
        self._latency = Histogram(
            "kv_transfer_latency_seconds", "first post (prefill) or init (decode) to Success", ["phase"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self._gbps = Histogram(
            "kv_transfer_bandwidth_gbps", "per-room bytes / (first post or init -> Success): not a link speed",
            ["phase"], buckets=_GBPS_BUCKETS, registry=r,
        )
        self._post = Histogram(
            "kv_transfer_post_seconds", "per WRITE handle: building and posting its descriptors", ["phase"],
            buckets=_POST_BUCKETS, registry=r,
        )
        self._wire = Histogram(
            "kv_transfer_wire_seconds", "per WRITE handle: posted -> NIXL reports DONE", ["phase"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self._wire_gbps = Histogram(
            "kv_transfer_wire_gbps", "per KV WRITE handle: bytes / (posted -> DONE)", ["phase"],
            buckets=_GBPS_BUCKETS, registry=r,
        )
        self._req_descs = Histogram(
            "kv_transfer_request_descriptors", "descriptors per transferred room (KV and aux)", ["phase"],
            buckets=_DESC_BUCKETS, registry=r,
        )
        self._totals: dict[str, Any] = {
            "bytes": 0, "descriptors": 0, "transfers": 0, "busy_s": 0.0,
            "post_s": 0.0, "wire_s": 0.0, "wire_bytes": 0, "handles": 0,
        }
        self._failed: dict[str, int] = {}

    def posted(self, nbytes: int, ndescs: int) -> None:
        self._bytes.labels(self.phase).inc(nbytes)
        self._descs.labels(self.phase).inc(ndescs)
        with self._lock:
            self._totals["bytes"] += nbytes
            self._totals["descriptors"] += ndescs

    def handle_done(self, nbytes: int, post_s: float, wire_s: float, *, kv: bool = True) -> None:
        """One WRITE handle reached DONE. kv=False (the aux row): timed, but kept out of GB/s."""
        self._post.labels(self.phase).observe(post_s)
        self._wire.labels(self.phase).observe(wire_s)
        if kv and wire_s > 0 and nbytes > 0:
            self._wire_gbps.labels(self.phase).observe(nbytes / wire_s / 1e9)
        with self._lock:
            self._totals["post_s"] += post_s
            self._totals["handles"] += 1
            if kv:
                self._totals["wire_s"] += wire_s
                self._totals["wire_bytes"] += nbytes

    def completed(self, nbytes: int, latency_s: float, ndescs: int | None = None) -> None:
        self._transfers.labels(self.phase).inc()
        self._latency.labels(self.phase).observe(latency_s)
        if latency_s > 0 and nbytes > 0:
            self._gbps.labels(self.phase).observe(nbytes / latency_s / 1e9)
        if ndescs is not None:
            self._req_descs.labels(self.phase).observe(ndescs)
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
        """{bytes, descriptors, transfers, failures: {cause: n}, gbps, latency_gbps, post_seconds,
        wire_seconds}. gbps: KV bytes / post -> DONE seconds of the handles (prefill); a side
        without handles (decode) falls back to bytes / room latency (= latency_gbps)."""
        with self._lock:
            out = dict(self._totals)
            out["failures"] = dict(self._failed)
        busy, wire_s, wire_bytes = out.pop("busy_s"), out.pop("wire_s"), out.pop("wire_bytes")
        out["latency_gbps"] = out["bytes"] / busy / 1e9 if busy > 0 else 0.0
        out["gbps"] = wire_bytes / wire_s / 1e9 if wire_s > 0 else out["latency_gbps"]
        out["post_seconds"] = out.pop("post_s")
        out["wire_seconds"] = wire_s
        return out
