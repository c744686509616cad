"""The Helm chart rendered by a real Helm engine (helm-python-sdk: Helm's Go SDK through libhelm_c,
no helm binary) into typed views the chart tests read.

    rendered = render_chart(values)        every object of the release, parsed
    rendered.deployment("router")          one role's Deployment; .container(...) its first container
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "pdserve"
RELEASE, NAMESPACE = "demo", "serving"


@dataclass(frozen=True)
class Rendered:
    objects: list[dict[str, Any]]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def deployment(self, role: str) -> dict[str, Any]:
        (d,) = [o for o in self.of_kind("Deployment") if o["metadata"]["name"] == f"{RELEASE}-pdserve-{role}"]
        return d

    @staticmethod
    def pod_spec(deployment: dict[str, Any]) -> dict[str, Any]:
        return deployment["spec"]["template"]["spec"]  # type: ignore[no-any-return]

    def container(self, role: str) -> dict[str, Any]:
        return self.pod_spec(self.deployment(role))["containers"][0]  # type: ignore[no-any-return]

    def pod_labels(self, role: str) -> dict[str, str]:
        return self.deployment(role)["spec"]["template"]["metadata"]["labels"]  # type: ignore[no-any-return]


def render_chart(values: dict[str, Any] | None = None) -> Rendered:
    import helm_python

    chart = helm_python.Chart.load(CHART)
    manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects = [doc for path, text in sorted(manifests.items()) if path.endswith((".yaml", ".yml"))
               for doc in yaml.safe_load_all(text) if doc]
    return Rendered(objects)


def lint_chart(values: dict[str, Any] | None = None, kube_version: str | None = None) -> dict[str, Any]:
    import helm_python

    return helm_python.lint(CHART, values, strict=True, namespace=NAMESPACE, kube_version=kube_version)


__all__ = ["CHART", "NAMESPACE", "RELEASE", "Rendered", "lint_chart", "render_chart"]
