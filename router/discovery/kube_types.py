"""The few fields of the Kubernetes API the router reads: typed msgspec Structs (unknown fields ignored).

PodList from a LIST, WatchEvent lines from a WATCH (`object` decoded as a Pod, or as a Status
for an ERROR event: 410 Gone means the resourceVersion is too old and the caller must LIST again).
"""

from __future__ import annotations

import msgspec


class ObjectMeta(msgspec.Struct, omit_defaults=True):
    name: str = ""
    namespace: str = ""
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}
    resourceVersion: str = ""  # noqa: N815 (the API's names)
    deletionTimestamp: str | None = None  # noqa: N815


class PodCondition(msgspec.Struct):
    type: str
    status: str


class PodStatus(msgspec.Struct, omit_defaults=True):
    phase: str = ""
    podIP: str | None = None  # noqa: N815
    conditions: list[PodCondition] = []


class Pod(msgspec.Struct, omit_defaults=True):
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    status: PodStatus = msgspec.field(default_factory=PodStatus)

    @property
    def key(self) -> str:
        return f"{self.metadata.namespace}/{self.metadata.name}"

    @property
    def ready(self) -> bool:
        """Running, its Ready condition True, and not being deleted."""
        if self.metadata.deletionTimestamp is not None or self.status.phase != "Running":
            return False
        return any(c.type == "Ready" and c.status == "True" for c in self.status.conditions)


class ListMeta(msgspec.Struct, omit_defaults=True):
    resourceVersion: str = ""  # noqa: N815


class PodList(msgspec.Struct, omit_defaults=True):
    items: list[Pod] = []
    metadata: ListMeta = msgspec.field(default_factory=ListMeta)


class Status(msgspec.Struct, omit_defaults=True):
    code: int = 0
    reason: str = ""
    message: str = ""


class WatchEvent(msgspec.Struct):
    type: str  # ADDED, MODIFIED, DELETED, BOOKMARK, ERROR
    object: msgspec.Raw


__all__ = ["ListMeta", "ObjectMeta", "Pod", "PodCondition", "PodList", "PodStatus", "Status", "WatchEvent"]
