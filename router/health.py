"""Periodic health checks and the readiness gate.

Every `health.interval_s` each worker gets GET /health (bounded by
`health.probe_timeout_s`); the outcome (ok, timeout, refused, reset, a non-200
status) goes to the worker's HealthState (health_state.py), which tells slow from
dead: a timeout only raises the load estimate, a worker that answered requests
since the last probe is alive whatever the probe says, refused/reset/5xx are
failures. All timings come from `RouterConfig.health`. A prefill worker without
a configured bootstrap port learns it from GET /server_info, as every worker learns its
prefix-cache facts (`Worker.cache_info`: where it publishes KV events, decode's local
prefill limit); a worker that goes down forgets them and learns them again when back.

Ready (GET /health of the router) = at least one healthy worker of each role AND,
in PD mode, one real bootstrap round trip succeeded: a tiny /generate
(max_new_tokens=1) sent to a healthy (P, D) pair with a fresh room. The round
trip is retried each interval until it succeeds, and again whenever a role had
no healthy worker left.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid

import httpx
import msgspec

from common.request_mac import RequestSigner
from router.config import RouterConfig
from router.health_state import ProbeOutcome
from router.kv_index import KVIndexes
from router.metrics import RouterMetrics
from router.periodic import Periodic
from router.plan import Bootstrap, GenerationPlan
from router.registry import WorkerRegistry
from router.worker import CacheInfo, Worker
from router.worker_auth import WorkerAuth

logger = logging.getLogger("router.health")


class HealthChecker:
    def __init__(self, cfg: RouterConfig, registry: WorkerRegistry, metrics: RouterMetrics,
                 probe_input_ids: list[int], kv_indexes: KVIndexes | None = None,
                 signer: RequestSigner | None = None) -> None:
        self.cfg = cfg
        self.auth = WorkerAuth(signer)
        self.registry = registry
        self.metrics = metrics
        self.probe_input_ids = probe_input_ids or [0]
        self.kv_indexes = kv_indexes
        self.pd_verified = not cfg.disaggregated
        self.last_probe_error: str | None = None
        self._client: httpx.AsyncClient | None = None
        self._rounds = Periodic("health", cfg.health.interval_s, self.check_all)

    @property
    def ready(self) -> bool:
        return self.pd_verified and all(self.registry.available(r) for r in self.registry.roles)

    def start(self) -> None:
        self._client = httpx.AsyncClient(timeout=self.cfg.health.probe_timeout_s, trust_env=False,
                                         auth=self.auth, limits=httpx.Limits(max_keepalive_connections=64))
        self._rounds.start()

    async def stop(self) -> None:
        await self._rounds.stop()
        if self._client is not None:
            await self._client.aclose()

    async def check_all(self) -> None:
        workers = self.registry.all()
        await asyncio.gather(*(self.check_worker(w) for w in workers))
        if self.kv_indexes is not None:
            for w in workers:
                if self.kv_indexes.stale(w.url):
                    w.cache_info = None  # no snapshot from where it said it publishes: ask again
            self.kv_indexes.sync(workers)
        if self.cfg.disaggregated:
            if not all(any(w.health.healthy for w in self.registry.of_role(r)) for r in self.registry.roles):
                self.pd_verified = False
            if not self.pd_verified:
                await self.probe_pair()

    async def check_worker(self, w: Worker) -> None:
        outcome = await self.probe(w)
        transition = w.health.record(outcome, self.cfg.health, now=time.monotonic(), progress_at=w.last_progress_at)
        self.metrics.health_checks.labels(w.role, outcome.kind).inc()
        if transition is not None:
            if transition == "down":
                w.cache_info = None
            self.metrics.health_transitions.labels(w.role, transition).inc()
            logger.warning("worker %s (%s) is now %s%s", w.url, w.role, transition.upper(),
                           f": {w.health.last_error}" if w.health.last_error else "")

    async def probe(self, w: Worker) -> ProbeOutcome:
        """GET /health once (and /server_info for a prefill's bootstrap port), classified."""
        assert self._client is not None, "HealthChecker.start() was not called"
        try:
            resp = await self._client.get(w.url + "/health")
            if resp.status_code != 200:
                return ProbeOutcome("status", f"/health returned {resp.status_code}: {_reason(resp)}")
            if w.cache_info is None or (w.role == "prefill" and w.bootstrap_port is None):
                await self._learn_server_info(w)
        except httpx.TimeoutException as e:
            return ProbeOutcome("timeout", f"no answer within {self.cfg.health.probe_timeout_s:g}s ({_name(e)})")
        except httpx.ConnectError as e:
            return ProbeOutcome("refused", _name(e))
        except httpx.HTTPError as e:
            return ProbeOutcome("reset", _name(e))
        except (msgspec.DecodeError, ValueError, TypeError) as e:
            return ProbeOutcome("server_info", f"bad /server_info: {e}")
        return ProbeOutcome("ok")

    async def _learn_server_info(self, w: Worker) -> None:
        assert self._client is not None
        resp = await self._client.get(w.url + "/server_info")
        resp.raise_for_status()
        info = msgspec.json.decode(resp.content)
        if w.role == "prefill" and w.bootstrap_port is None:
            port = info.get("bootstrap_port")
            if port is None:  # bootstrap routes served on the HTTP port itself
                port = httpx.URL(w.url).port or 80
            if not isinstance(port, int) or not 0 < port < 65536:
                raise ValueError(f"bootstrap_port {port!r}")
            w.bootstrap_port = port
        events_port = info.get("kv_events_port")
        local_max = info.get("local_prefill_max_tokens") or 0
        if not (events_port is None or isinstance(events_port, int)) or not isinstance(local_max, int):
            raise ValueError(f"kv_events_port {events_port!r}, local_prefill_max_tokens {local_max!r}")
        host = f"[{w.host}]" if ":" in w.host else w.host  # the address the router reaches the worker at
        w.cache_info = CacheInfo(f"tcp://{host}:{events_port}" if events_port else None, local_max)

    async def probe_pair(self) -> bool:
        """One real PD round trip through a healthy pair; sets pd_verified on success."""
        assert self._client is not None
        prefills, decodes = self.registry.available("prefill"), self.registry.available("decode")
        if not prefills or not decodes:
            return False
        p, d = prefills[0], decodes[0]
        assert p.bootstrap_port is not None
        plan = GenerationPlan("generate", self.cfg.model_name, self.probe_input_ids,
                              {"max_new_tokens": 1, "temperature": 0.0}, stream=False)
        rid = "health-" + uuid.uuid4().hex
        body = plan.worker_body(rid, Bootstrap(p.host, p.bootstrap_port, secrets.randbits(63)), stream=False)
        timeout = self.cfg.health.pair_probe_timeout_s
        headers = {"Content-Type": "application/json", "X-Request-Id": rid}
        try:
            rp, rd = await asyncio.gather(
                self._client.post(p.url + "/generate", content=body, headers=headers, timeout=timeout),
                self._client.post(d.url + "/generate", content=body, headers=headers, timeout=timeout),
            )
        except httpx.HTTPError as e:
            self.last_probe_error = f"{type(e).__name__}: {e}"
        else:
            if rp.status_code == 200 and rd.status_code == 200:
                self.pd_verified, self.last_probe_error = True, None
                p.note_progress()
                d.note_progress()
                logger.info("bootstrap round trip %s -> %s succeeded; router is ready", p.url, d.url)
                return True
            self.last_probe_error = (f"prefill {p.url} -> {rp.status_code} {rp.text[:200]}; "
                                     f"decode {d.url} -> {rd.status_code} {rd.text[:200]}")
        logger.warning("bootstrap round trip failed: %s", self.last_probe_error)
        return False


def _name(e: Exception) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _reason(resp: httpx.Response) -> str:
    """The worker's own words from an error body (docs/generate_api.md shape), else its start."""
    try:
        err = msgspec.json.decode(resp.content).get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])[:300]
    except (msgspec.DecodeError, AttributeError):
        pass
    return resp.text[:300]
