"""Which pod is which worker: selectors matched on the client side, whatever the server filtered.

A pod is a worker when its labels carry every pair of one role's selector and it is Running,
Ready and not being deleted (Pod.ready). Its URL is http://<pod IP>:<--service-discovery-port>;
a prefill's bootstrap port comes from the --bootstrap-port-annotation (absent: the router
learns it from the worker's /server_info, as for a prefill given without one).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from router.config import Role, RouterConfig, Selector, WorkerSpec
from router.discovery.kube_types import Pod

logger = logging.getLogger("router.discovery")


@dataclass(frozen=True)
class RoleSelector:
    role: Role
    labels: Selector

    def matches(self, pod: Pod) -> bool:
        have = pod.metadata.labels
        return all(have.get(k) == v for k, v in self.labels)


@dataclass(frozen=True)
class PodMatcher:
    selectors: tuple[RoleSelector, ...]
    port: int
    bootstrap_annotation: str

    @classmethod
    def from_config(cls, cfg: RouterConfig) -> PodMatcher:
        sels: tuple[RoleSelector, ...]
        if cfg.selector:
            sels = (RoleSelector("colocated", cfg.selector),)
        else:
            sels = (RoleSelector("prefill", cfg.prefill_selector), RoleSelector("decode", cfg.decode_selector))
        return cls(sels, cfg.service_discovery_port, cfg.bootstrap_port_annotation)

    @property
    def common_label_selector(self) -> str:
        """The pairs every role's selector has: a hint for the server (`labelSelector`), never trusted."""
        common = set(self.selectors[0].labels).intersection(*(s.labels for s in self.selectors[1:]))
        return ",".join(f"{k}={v}" for k, v in sorted(common))

    def role_of(self, pod: Pod) -> Role | None:
        roles = [s.role for s in self.selectors if s.matches(pod)]
        if len(roles) > 1:
            logger.warning("pod %s matches both the prefill and the decode selector: ignored", pod.key)
            return None
        return roles[0] if roles else None

    def worker(self, pod: Pod) -> WorkerSpec | None:
        """The worker this pod is now, or None (no role, not ready, being deleted, no IP)."""
        role = self.role_of(pod)
        if role is None or not pod.ready or not pod.status.podIP:
            return None
        ip = pod.status.podIP
        host = f"[{ip}]" if ":" in ip else ip
        return WorkerSpec(f"http://{host}:{self.port}", role, self._bootstrap_port(pod) if role == "prefill" else None,
                          source="discovery", pod=pod.key)

    def _bootstrap_port(self, pod: Pod) -> int | None:
        raw = pod.metadata.annotations.get(self.bootstrap_annotation)
        if raw is None:
            return None
        if raw.isdigit() and 0 < int(raw) < 65536:
            return int(raw)
        logger.warning("pod %s: annotation %s=%r is not a port: learning it from /server_info",
                       pod.key, self.bootstrap_annotation, raw)
        return None


__all__ = ["PodMatcher", "RoleSelector"]
