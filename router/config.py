"""Router configuration: one frozen dataclass, argparse defaults read from it.

    python -m router --model-path DIR --prefill URL [BOOTSTRAP_PORT] ... --decode URL ...
    python -m router --model-path DIR --worker URL ...            (colocated baseline)

`RouterConfig.from_args(argv)` parses and validates once; the keys come from --api-key-file /
--admin-api-key-file, else the environment (PDSERVE_API_KEY, PDSERVE_ADMIN_API_KEY, like vLLM's
VLLM_API_KEY), never needing the command line (common.secret_file). A prefill worker's bootstrap port may be omitted: the router then
learns it from the worker's `/server_info` before routing to it. Every health
timing is read from one derived record, `RouterConfig.health` (HealthConfig).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

from common.secret_file import resolve_secret
from common.server.conn_limits import DEFAULT_HEADER_TIMEOUT_S, BodyLimits
from common.server.liveness import HEALTH_ANSWER_BOUND_S
from common.version import add_version_flag

Role = Literal["prefill", "decode", "colocated"]
Selector = tuple[tuple[str, str], ...]
POLICIES = ("round_robin", "random", "power_of_two", "cache_aware", "load_aware")


def normalize_url(url: str) -> str:
    """`host:port` or `http://host:port/` -> `http://host:port`; ValueError if it is not an http URL
    (https too: the router's worker client speaks no TLS, and must not fall back to plain HTTP)."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme == "https":
        raise ValueError(f"https worker URLs are not supported (the router -> worker client speaks plain HTTP, "
                         f"authenticated per request by the cluster secret): use http:// on the cluster network, "
                         f"not {parts.scheme}://{parts.hostname}")
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"not an http URL: {url!r}")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"worker URL must not carry user:password@ (workers authenticate by the cluster secret): "
                         f"{parts.scheme}://{parts.hostname}")
    if parts.path not in ("", "/") or parts.query:
        raise ValueError(f"worker URL must not have a path or query: {url!r}")
    _ = parts.port  # raises ValueError on a bad port
    return f"{parts.scheme}://{parts.netloc}"


@dataclass(frozen=True)
class WorkerSpec:
    url: str
    role: Role
    bootstrap_port: int | None = None  # prefill only; None: learn it from /server_info
    source: str = "command-line"  # how the router found it: command-line, api (POST /workers), discovery
    pod: str | None = None  # discovery: the pod's namespace/name


@dataclass(frozen=True)
class HealthConfig:
    """Every health timing of the router, derived in one place (RouterConfig.health).

    A worker's /health answers from its engine's step clock within HEALTH_ANSWER_BOUND_S
    and never waits for a step (common/server/liveness.py), so a probe that times out
    (probe_timeout_s, always longer than that bound) means a loaded worker, not a dead
    one: it raises the worker's load estimate by slow_probe_load per timeout in a row
    (at most max_slow_probes). Only a worker that answered nothing, neither a probe nor
    a request, for unresponsive_after_s is marked down. Refused or reset connections
    and non-200 answers are failures; failure_threshold of them in a row mark it down.
    """

    interval_s: float
    probe_timeout_s: float
    failure_threshold: int
    success_threshold: int
    unresponsive_after_s: float
    pair_probe_timeout_s: float  # the readiness round trip through a (prefill, decode) pair
    slow_probe_load: int = 4
    max_slow_probes: int = 4


@dataclass(frozen=True)
class RouterConfig:
    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    prefill: tuple[WorkerSpec, ...] = ()
    decode: tuple[WorkerSpec, ...] = ()
    worker: tuple[WorkerSpec, ...] = ()
    served_model_name: str | None = None
    context_length: int | None = None  # None: from the model's config.json
    default_max_tokens_cap: int = 4096
    prefill_policy: str = "cache_aware"
    decode_policy: str = "power_of_two"
    request_timeout: float = 600.0
    connect_timeout: float = 5.0
    max_retries: int = 3
    max_migrations: int = 1  # a stream whose decode fails after the first byte moves to a new pair (0: off)
    max_queued_requests: int = 1024  # requests waiting for a decode with room; beyond it 503 at once
    queue_timeout: float | None = None  # seconds a request may wait for room, then 503 (None: the client decides)
    kv_event_wait: float = 0.05  # a session's turn waits this long at most for its last turn's KV event (0: never)
    load_report_interval: float = 0.25  # seconds between GET /get_load rounds (0: no load reports)
    retry_backoff_initial: float = 0.02
    retry_backoff_max: float = 1.0
    health_check_interval: float = 5.0
    health_check_timeout: float = 3.0
    health_failure_threshold: int = 2
    health_success_threshold: int = 1
    health_unresponsive_timeout: float | None = None  # None: failure_threshold x (interval + timeout)
    breaker_failure_threshold: int = 5
    breaker_success_threshold: int = 2
    breaker_open_seconds: float = 10.0
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    max_tree_tokens: int = 1 << 20
    max_connections: int = 2048
    max_body_bytes: int = 8 << 20
    incremental_streaming_output: bool = False  # /generate streams deltas (default: cumulative, as SGLang)
    cluster_secret_file: str | None = None  # None: $PDSERVE_CLUSTER_SECRET, else no secret (see common.cluster_secret)
    allow_unauthenticated: bool = False
    allow_unauthenticated_clients: bool = False  # a non-loopback --host without --api-key (refused otherwise)
    enable_priority_scheduling: bool = False  # honour clients' `priority` (SGLang's flag); else 400
    allowed_hosts: tuple[str, ...] = ()  # Host names answered besides loopback ones (router/host_check.py)
    enable_docs: bool = False  # /docs (Swagger UI from a CDN); /openapi.json is always served
    log_level: str = "info"
    api_key: str | None = field(default=None, repr=False)  # clients: /v1/*, /generate
    admin_api_key: str | None = field(default=None, repr=False)  # /workers; None: worker admin is off
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S  # seconds a client may take to send a request head
    max_stream_backlog: int = 1024  # worker events held for a streaming client that does not read
    max_prompt_chars: int | None = None  # None: 32 x the context length; checked before tokenizing
    body_timeout: float = BodyLimits.timeout_s  # head + body within this from the first byte
    min_body_rate: int = BodyLimits.min_rate  # bytes/s a body must keep up (0: off)
    max_body_bytes_in_flight: int = BodyLimits.max_in_flight  # unfinished bodies over all connections; 503 past it
    max_prompt_logprob_entries: int = 100_000  # (prompt - logprob_start_len) x max(1, top logprobs); 400 past it
    max_chat_messages: int = 2048
    # Kubernetes service discovery (router/discovery): SGLang's flag names
    service_discovery: bool = False
    selector: Selector = ()  # colocated workers' pod labels
    prefill_selector: Selector = ()
    decode_selector: Selector = ()
    service_discovery_namespace: str | None = None  # None: every namespace the credentials may list
    service_discovery_port: int = 30000  # the workers' HTTP port in their pods
    bootstrap_port_annotation: str = "pdserve.io/bootstrap-port"
    service_discovery_resync: float = 30.0  # seconds between full re-LISTs that repair a missed watch event
    kubeconfig: str | None = None  # None: the in-cluster service account

    @property
    def body_limits(self) -> BodyLimits:
        return BodyLimits(self.body_timeout, self.min_body_rate, self.max_body_bytes_in_flight)

    @property
    def disaggregated(self) -> bool:
        return not self.worker and not self.selector

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path

    def all_workers(self) -> tuple[WorkerSpec, ...]:
        return self.prefill + self.decode + self.worker

    @property
    def health(self) -> HealthConfig:
        unresponsive = self.health_unresponsive_timeout
        if unresponsive is None:
            unresponsive = self.health_failure_threshold * (self.health_check_interval + self.health_check_timeout)
        return HealthConfig(
            interval_s=self.health_check_interval,
            probe_timeout_s=self.health_check_timeout,
            failure_threshold=self.health_failure_threshold,
            success_threshold=self.health_success_threshold,
            unresponsive_after_s=unresponsive,
            pair_probe_timeout_s=max(self.health_check_timeout, min(self.request_timeout, 30.0)),
        )

    def validate(self) -> None:
        if self.worker and (self.prefill or self.decode):
            raise ValueError("--worker (colocated) cannot be combined with --prefill/--decode")
        for name in ("prefill_policy", "decode_policy"):
            if getattr(self, name) not in POLICIES:
                raise ValueError(f"{name} must be one of {POLICIES}, got {getattr(self, name)!r}")
        if self.max_migrations < 0 or self.max_queued_requests < 0 or self.load_report_interval < 0:
            raise ValueError("max_migrations, max_queued_requests and load_report_interval must be >= 0")
        if self.kv_event_wait < 0:
            raise ValueError("kv_event_wait must be >= 0")
        if self.queue_timeout is not None and self.queue_timeout <= 0:
            raise ValueError("queue_timeout must be > 0")
        if self.max_retries < 0 or self.request_timeout <= 0 or self.health_check_interval <= 0:
            raise ValueError("max_retries must be >= 0, request_timeout and health_check_interval > 0")
        if min(self.health_failure_threshold, self.health_success_threshold) < 1:
            raise ValueError("health thresholds must be >= 1")
        if self.health_check_timeout <= HEALTH_ANSWER_BOUND_S:
            raise ValueError(
                f"health_check_timeout must be longer than a worker's own /health bound "
                f"({HEALTH_ANSWER_BOUND_S:g} s), got {self.health_check_timeout:g}"
            )
        if self.health.unresponsive_after_s <= self.health_check_timeout:
            raise ValueError("health_unresponsive_timeout must be longer than health_check_timeout")
        if min(self.breaker_failure_threshold, self.breaker_success_threshold) < 1:
            raise ValueError("breaker thresholds must be >= 1")
        if self.header_timeout <= 0 or self.max_stream_backlog < 1:
            raise ValueError("header_timeout must be > 0 and max_stream_backlog >= 1")
        if min(self.body_timeout, self.max_body_bytes_in_flight, self.max_prompt_logprob_entries,
               self.max_chat_messages) <= 0 or self.min_body_rate < 0:
            raise ValueError("body_timeout, max_body_bytes_in_flight, max_prompt_logprob_entries and "
                             "max_chat_messages must be > 0, min_body_rate >= 0")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ValueError("max_prompt_chars must be >= 1")
        for name in ("api_key", "admin_api_key"):
            if getattr(self, name) == "":
                raise ValueError(f"{name} must not be empty")
        self._validate_discovery()
        urls = [w.url for w in self.all_workers()]
        if len(set(urls)) != len(urls):
            raise ValueError("a worker URL is listed twice")

    def _validate_discovery(self) -> None:
        selectors = (self.selector, self.prefill_selector, self.decode_selector)
        if not self.service_discovery:
            if any(selectors):
                raise ValueError("--selector/--prefill-selector/--decode-selector need --service-discovery")
            return
        if self.selector and (self.prefill_selector or self.decode_selector or self.prefill or self.decode):
            raise ValueError("--selector (colocated) cannot be combined with prefill/decode workers or selectors")
        if self.worker and not self.selector:
            raise ValueError("--worker (colocated) with --service-discovery needs --selector, not prefill/decode ones")
        if not self.selector and not (self.prefill_selector and self.decode_selector):
            raise ValueError("--service-discovery needs --prefill-selector and --decode-selector (or --selector)")
        if not 0 < self.service_discovery_port < 65536 or self.service_discovery_resync <= 0:
            raise ValueError("service_discovery_port must be a port and service_discovery_resync > 0")

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> RouterConfig:
        ns = build_parser().parse_args(argv)
        values = vars(ns)
        values["api_key"] = resolve_secret("--api-key", values["api_key"], values.pop("api_key_file"),
                                           "PDSERVE_API_KEY")
        values["admin_api_key"] = resolve_secret("--admin-api-key", values["admin_api_key"],
                                                 values.pop("admin_api_key_file"), "PDSERVE_ADMIN_API_KEY")
        policy = values.pop("policy")
        for role in ("prefill", "decode"):
            if values[f"{role}_policy"] is None:
                values[f"{role}_policy"] = policy or _DEFAULTS[f"{role}_policy"]
        values["prefill"] = tuple(_prefill_spec(v) for v in values["prefill"] or [])
        values["decode"] = tuple(WorkerSpec(normalize_url(u), "decode") for u in values["decode"] or [])
        values["worker"] = tuple(WorkerSpec(normalize_url(u), "colocated") for u in values["worker"] or [])
        for name in ("selector", "prefill_selector", "decode_selector"):
            values[name] = parse_selector(values[name] or [])
        values["allowed_hosts"] = tuple(values["allowed_hosts"] or ())
        cfg = cls(**values)
        cfg.validate()
        return cfg


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RouterConfig)}


def parse_selector(items: list[str]) -> Selector:
    """`["app=pdserve", "role=prefill"]` (SGLang's form) -> sorted (key, value) pairs."""
    pairs: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"a selector is KEY=VALUE items, got {item!r}")
        pairs[key] = value
    return tuple(sorted(pairs.items()))


def _prefill_spec(items: list[str]) -> WorkerSpec:
    if not 1 <= len(items) <= 2:
        raise SystemExit("--prefill takes URL [BOOTSTRAP_PORT]")
    port = None
    if len(items) == 2:
        if not items[1].isdigit() or not 0 < int(items[1]) < 65536:
            raise SystemExit(f"--prefill bootstrap port must be an integer port, got {items[1]!r}")
        port = int(items[1])
    return WorkerSpec(normalize_url(items[0]), "prefill", port)


def build_parser() -> argparse.ArgumentParser:
    d = _DEFAULTS
    p = argparse.ArgumentParser(prog="python -m router", description="OpenAI-compatible PD router")
    add_version_flag(p, "router")
    p.add_argument("--model-path", required=True, help="checkpoint dir: tokenizer, chat template, context length")
    p.add_argument("--host", default=d["host"])
    p.add_argument("--port", type=int, default=d["port"])
    p.add_argument("--prefill", nargs="+", action="append", metavar="URL [BOOTSTRAP_PORT]")
    p.add_argument("--decode", action="append", metavar="URL")
    p.add_argument("--worker", action="append", metavar="URL", help="colocated instance (no disaggregation)")
    p.add_argument("--served-model-name", default=d["served_model_name"])
    p.add_argument("--context-length", type=int, default=d["context_length"])
    p.add_argument("--default-max-tokens-cap", type=int, default=d["default_max_tokens_cap"])
    p.add_argument("--policy", choices=POLICIES, default=None, help="both roles (and colocated workers)")
    p.add_argument("--prefill-policy", choices=POLICIES, default=None)
    p.add_argument("--decode-policy", choices=POLICIES, default=None)
    for name in (
        "request_timeout",
        "connect_timeout",
        "retry_backoff_initial",
        "retry_backoff_max",
        "health_check_interval",
        "health_check_timeout",
        "header_timeout",
        "body_timeout",
        "breaker_open_seconds",
        "cache_threshold",
        "balance_rel_threshold",
        "load_report_interval",
        "kv_event_wait",
    ):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=d[name])
    p.add_argument("--queue-timeout", type=float, default=d["queue_timeout"],
                   help="seconds a request may wait in the router's queue for a decode with room, then 503 "
                        "(default: no limit, as SGLang and vLLM; the client's own timeout decides)")
    for name in (
        "max_retries",
        "max_migrations",
        "max_queued_requests",
        "health_failure_threshold",
        "health_success_threshold",
        "breaker_failure_threshold",
        "breaker_success_threshold",
        "balance_abs_threshold",
        "max_tree_tokens",
        "max_connections",
        "max_body_bytes",
        "max_stream_backlog",
        "min_body_rate",
        "max_body_bytes_in_flight",
        "max_prompt_logprob_entries",
        "max_chat_messages",
    ):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=d[name])
    p.add_argument("--health-unresponsive-timeout", type=float, default=d["health_unresponsive_timeout"],
                   help="seconds without any answer (probe or request) before a worker is down "
                        "(default: failure threshold x (interval + timeout))")
    p.add_argument("--incremental-streaming-output", action="store_true",
                   help="/generate streams deltas of text and output_ids (default: cumulative events, as SGLang); "
                        "a request's `incremental_stream` overrides it")
    p.add_argument("--cluster-secret-file", default=d["cluster_secret_file"],
                   help="file holding the cluster secret the router presents to workers "
                        "(default: $PDSERVE_CLUSTER_SECRET)")
    p.add_argument("--allow-unauthenticated", action="store_true",
                   help="serve a non-loopback --host without a cluster secret (refused otherwise)")
    p.add_argument("--allow-unauthenticated-clients", action="store_true",
                   help="serve clients on a non-loopback --host without --api-key (refused otherwise)")
    p.add_argument("--allowed-hosts", nargs="+", default=None, metavar="NAME",
                   help="Host header names the router answers (421 otherwise); without --api-key on loopback "
                        "only loopback names are answered, against DNS rebinding")
    p.add_argument("--enable-priority-scheduling", action="store_true",
                   help="pass clients' /generate `priority` to workers (default: such requests get 400)")
    p.add_argument("--enable-docs", action="store_true",
                   help="serve the Swagger UI at /docs (it loads its script from cdn.jsdelivr.net)")
    p.add_argument("--max-prompt-chars", type=int, default=d["max_prompt_chars"],
                   help="longest prompt in characters, refused before tokenizing (default: 32 x context length)")
    p.add_argument("--api-key-file", default=None,
                   help="file holding the key clients must send as 'Authorization: Bearer KEY' on /v1/* and "
                        "/generate (default: $PDSERVE_API_KEY; unset: open)")
    p.add_argument("--admin-api-key-file", default=None,
                   help="file holding the key for GET/POST/DELETE /workers (default: $PDSERVE_ADMIN_API_KEY; "
                        "unset: those answer 403)")
    p.add_argument("--api-key", default=None,
                   help="the client key itself (SGLang's flag; visible in `ps`: prefer --api-key-file)")
    p.add_argument("--admin-api-key", default=None,
                   help="the admin key itself (visible in `ps`: prefer --admin-api-key-file)")
    p.add_argument("--log-level", default=d["log_level"])
    _add_discovery_flags(p)
    return p


def _add_discovery_flags(p: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    g = p.add_argument_group("Kubernetes service discovery (router/discovery)")
    g.add_argument("--service-discovery", action="store_true",
                   help="find workers as pods: LIST then WATCH pods, Running + Ready ones matching a selector")
    g.add_argument("--selector", nargs="+", metavar="KEY=VALUE", help="colocated workers' pod labels")
    g.add_argument("--prefill-selector", nargs="+", metavar="KEY=VALUE", help="prefill pods' labels")
    g.add_argument("--decode-selector", nargs="+", metavar="KEY=VALUE", help="decode pods' labels")
    g.add_argument("--service-discovery-namespace", default=d["service_discovery_namespace"],
                   help="namespace to watch (default: all the credentials may list)")
    g.add_argument("--service-discovery-port", type=int, default=d["service_discovery_port"],
                   help="the workers' HTTP port in their pods")
    g.add_argument("--bootstrap-port-annotation", default=d["bootstrap_port_annotation"],
                   help="pod annotation holding a prefill's bootstrap port")
    g.add_argument("--service-discovery-resync", type=float, default=d["service_discovery_resync"],
                   help="seconds between full re-LISTs that repair anything a watch missed")
    g.add_argument("--kubeconfig", default=d["kubeconfig"],
                   help="kubeconfig file, for a router outside the cluster (default: the in-cluster service account)")


def replace(cfg: RouterConfig, **changes: object) -> RouterConfig:
    """A validated copy with some fields changed (tests, embedding)."""
    out = dataclasses.replace(cfg, **changes)  # type: ignore[arg-type]
    out.validate()
    return out


__all__ = ["POLICIES", "HealthConfig", "RouterConfig", "Role", "WorkerSpec", "Selector", "build_parser", "normalize_url",
           "parse_selector", "replace"]
