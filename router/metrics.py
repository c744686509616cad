"""Prometheus metrics of one router (own CollectorRegistry, so several routers can share a process).

Hot-path metrics are plain counters/histograms; per-worker gauges (health, breaker,
in-flight load) are read from the registry at scrape time by a custom collector.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from router.prefix_tree import PrefixTree
from router.registry import WorkerRegistry

if TYPE_CHECKING:
    from router.admission import Admission

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class _WorkerCollector(Collector):
    def __init__(self, registry: WorkerRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = ["worker", "role"]  # worker: its name (/workers maps it to the URL), never the URL
        healthy = GaugeMetricFamily("router_worker_healthy", "1 if the worker passes health checks", labels=labels)
        breaker = GaugeMetricFamily("router_worker_breaker_state", "0 closed, 1 half-open, 2 open", labels=labels)
        reqs = GaugeMetricFamily("router_worker_inflight_requests", "requests in flight", labels=labels)
        toks = GaugeMetricFamily("router_worker_inflight_tokens", "tokens of requests in flight", labels=labels)
        load = GaugeMetricFamily("router_worker_load", "load estimate: in flight + slow-probe penalty", labels=labels)
        panic = CounterMetricFamily("router_panic_routed", "picks made among down workers (no healthy one of "
                                    "the role)", labels=["role"])
        for w in self.registry.all():
            lv = [w.name, w.role]
            healthy.add_metric(lv, 1.0 if w.health.healthy else 0.0)
            breaker.add_metric(lv, float(w.breaker.state))
            reqs.add_metric(lv, float(w.in_flight_requests))
            toks.add_metric(lv, float(w.in_flight_tokens))
            load.add_metric(lv, float(w.load))
        for role, n in self.registry.panic_picks.items():
            panic.add_metric([role], float(n))
        nodes = GaugeMetricFamily("router_prefix_tree_nodes", "nodes of the role's prefix tree", labels=["role"])
        cost = GaugeMetricFamily("router_prefix_tree_cost", "tokens + 8 per node of the role's prefix tree (bounded "
                                 "by --max-tree-tokens)", labels=["role"])
        for role, policy in self.registry.policies.items():
            tree = getattr(policy, "tree", None)
            if isinstance(tree, PrefixTree):
                nodes.add_metric([role], float(tree.nodes))
                cost.add_metric([role], float(tree.cost))
        yield from (healthy, breaker, reqs, toks, load, panic, nodes, cost)


class RouterMetrics:
    def __init__(self, registry: WorkerRegistry) -> None:
        self.prom = CollectorRegistry()
        r = self.prom
        self.requests = Counter("router_requests", "requests by route and status", ["route", "status"], registry=r)
        self.ttft = Histogram("router_ttft_seconds", "time to first token (streamed)", ["route"],
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("router_itl_seconds", "time between streamed events", ["route"], buckets=_ITL_BUCKETS,
                             registry=r)
        self.e2e = Histogram("router_e2e_seconds", "request latency, arrival to last byte", ["route"],
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.retries = Counter("router_retries", "attempts retried", ["reason"], registry=r)
        self.migrations = Counter("router_migrations", "streams moved to a new pair after their decode failed",
                                  ["reason"], registry=r)
        self.errors = Counter("router_errors", "failed requests by cause", ["cause"], registry=r)
        self.health_checks = Counter("router_health_checks", "health probes by outcome (ok, timeout, refused, "
                                     "reset, status, server_info)", ["role", "result"], registry=r)
        self.health_transitions = Counter("router_worker_health_transitions", "workers marked up or down",
                                          ["role", "to"], registry=r)
        self.decode_choice = Counter("router_decode_choice", "PD picks by why that decode (session, cache, "
                                     "policy) and whether a prefill took part (prefill) or decode prefilled "
                                     "alone from its cache (local)", ["reason", "prefill"], registry=r)
        r.register(_WorkerCollector(registry))
        self.queued = Gauge("router_queued_requests", "requests waiting for a decode with room", registry=r)
        self.queue_rejected = Counter("router_queue_rejected", "503s of the admission queue (full, timeout)",
                                      ["reason"], registry=r)

    def watch_admission(self, admission: Admission) -> None:
        self.queued.set_function(lambda: admission.waiting)

    def render(self) -> bytes:
        return generate_latest(self.prom)
