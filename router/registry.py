"""Worker registry: the set of workers per role, and the policy that picks among them.

Owns every Worker. Static workers come from the config; `add`/`remove` serve
POST/DELETE /workers at runtime. A removed worker keeps serving the requests it
already has (their LoadGuards still point at it) but is never picked again.

Panic routing (Envoy's panic threshold): when a role has no available worker but
some are down only because their probes fail while they still answer (a 5xx or a
reset, not a refused connection or silence), `select` picks among those instead of
answering 503; `panic_picks` counts it per role.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from router.breaker import CircuitBreaker
from router.config import Role, RouterConfig, WorkerSpec
from router.errors import ApiError
from router.policies import ExactMatch, Policy, make_policy
from router.worker import Worker

ROLE_LABEL = {"prefill": "prefill", "decode": "decode", "colocated": "worker"}
logger = logging.getLogger("router.registry")


class WorkerRegistry:
    def __init__(self, cfg: RouterConfig, exact_match: ExactMatch | None = None) -> None:
        self.cfg = cfg
        self.roles: tuple[Role, ...] = ("prefill", "decode") if cfg.disaggregated else ("colocated",)
        self._workers: dict[Role, list[Worker]] = {r: [] for r in self.roles}
        self._by_url: dict[str, Worker] = {}
        policy_names: dict[Role, str] = {
            "prefill": cfg.prefill_policy,
            "decode": cfg.decode_policy,
            "colocated": cfg.decode_policy,
        }
        self.policies: dict[Role, Policy] = {
            r: make_policy(
                policy_names[r],
                role=r,
                cache_threshold=cfg.cache_threshold,
                balance_abs=cfg.balance_abs_threshold,
                balance_rel=cfg.balance_rel_threshold,
                max_tree_tokens=cfg.max_tree_tokens,
                exact_match=exact_match,
            )
            for r in self.roles
        }
        self.panic_picks: dict[Role, int] = {r: 0 for r in self.roles}
        self._panicking: set[Role] = set()
        self._added = 0
        for spec in cfg.all_workers():
            self.add(spec)

    def add(self, spec: WorkerSpec) -> Worker:
        if spec.role not in self.roles:
            mode = "disaggregated (prefill/decode)" if self.cfg.disaggregated else "colocated (worker)"
            raise ApiError(400, f"role {spec.role!r} does not exist in {mode} mode", param="role")
        if spec.url in self._by_url:
            raise ApiError(409, f"worker {spec.url} is already registered", param="url", code="worker_exists")
        breaker = CircuitBreaker(
            self.cfg.breaker_failure_threshold, self.cfg.breaker_success_threshold, self.cfg.breaker_open_seconds
        )
        w = Worker(spec.url, spec.role, breaker, spec.bootstrap_port)
        w.source, w.pod = spec.source, spec.pod
        w.name = f"{spec.role}-{self._added}"
        self._added += 1
        self._workers[spec.role].append(w)
        self._by_url[spec.url] = w
        return w

    def remove(self, url: str) -> Worker:
        w = self._by_url.pop(url, None)
        if w is None:
            raise ApiError(404, f"no worker {url}", param="url", code="worker_not_found")
        w.removed = True
        self._workers[w.role].remove(w)
        self.policies[w.role].on_worker_removed(url)
        return w

    def get(self, url: str) -> Worker | None:
        return self._by_url.get(url)

    def all(self) -> list[Worker]:
        return [w for r in self.roles for w in self._workers[r]]

    def of_role(self, role: Role) -> Sequence[Worker]:
        return self._workers[role]

    def available(self, role: Role) -> list[Worker]:
        return [w for w in self._workers[role] if w.available]

    def select(self, role: Role, input_ids: Sequence[int], exclude: frozenset[str] = frozenset(),
               prefer: Callable[[Worker], bool] | None = None) -> Worker:
        """Pick an available worker of `role`, avoiding `exclude` (earlier failed attempts) if possible,
        among those `prefer` accepts (decodes with room) if any.

        Raises ApiError 503 if none is available."""
        return self.policies[role].select(self.candidates(role, exclude, prefer), input_ids)

    def candidates(self, role: Role, exclude: frozenset[str] = frozenset(),
                   prefer: Callable[[Worker], bool] | None = None) -> list[Worker]:
        """The workers of `role` a pick may choose from: the available ones (else, in panic, the down
        ones still answering), without `exclude` unless that leaves none, and of those the ones
        `prefer` accepts if any. Raises ApiError 503 if none."""
        candidates = self.available(role)
        if candidates:
            if role in self._panicking:
                self._panicking.discard(role)
                logger.warning("%s workers healthy again: panic routing ends", ROLE_LABEL[role])
        else:
            candidates = self._panic_candidates(role)
        if not candidates:
            total = len(self._workers[role])
            raise ApiError(
                503,
                f"no healthy {ROLE_LABEL[role]} worker available ({total} registered, all down or circuit open)",
                type="service_unavailable",
                code="no_healthy_worker",
            )
        preferred = [w for w in candidates if w.url not in exclude] if exclude else candidates
        preferred = preferred or candidates
        if prefer is not None:
            preferred = [w for w in preferred if prefer(w)] or preferred
        return preferred

    def _panic_candidates(self, role: Role) -> list[Worker]:
        out = [w for w in self._workers[role] if w.panic_available]
        if out:
            self.panic_picks[role] += 1
            if role not in self._panicking:
                self._panicking.add(role)
                logger.warning(
                    "no healthy %s worker: panic routing to %d worker(s) that fail probes but still answer (%s)",
                    ROLE_LABEL[role], len(out), "; ".join(f"{w.url}: {w.health.last_error}" for w in out),
                )
        return out
