"""deploy/helm/pdserve rendered by a real Helm engine for the default values and two other value
sets; every object validated with kubernetes-validate --strict against Kubernetes 1.29 and 1.33;
and what must hold across objects, checked on the rendered YAML: selectors match pod labels, the
flags parse with the servers' own parsers, probe paths exist in the servers' route tables,
secrets arrive only as mounted files, grace periods cover preStop + drain, GPUs only when asked.
"""

from __future__ import annotations

import re
from typing import Any

import kubernetes_validate
import pytest

pytest.importorskip("helm_python", reason="helm-python-sdk ships libhelm_c for linux x86_64 only")

from common.server.http_server import INSTANCE_ROUTES
from common.server.server_args import parse_server_args
from router.app import ROUTER_ROUTES
from router.config import RouterConfig
from tests.k8s.chart import CHART, NAMESPACE, RELEASE, Rendered, lint_chart, render_chart

KUBE_VERSIONS = ("1.29.0", "1.33.0")
API_KEY, ADMIN_KEY = "sk-test-client-key-4c1d", "sk-test-admin-key-77ab"
VALUE_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    "gpu": {  # GPUs, more replicas, a checkpoint on a PVC, the operator's own Secret
        "prefill": {"replicas": 2, "gpus": 1, "extraArgs": ["--max-total-tokens", "65536"],
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
        "decode": {"replicas": 4, "gpus": 2, "resources": {"limits": {"memory": "64Gi"}}},
        "model": {"path": "/models/Llama-3.1-8B-Instruct", "init": {"enabled": False},
                  "volume": {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}}},
        "secrets": {"existingSecret": "pdserve-keys"},
        "servedModelName": "llama-8b",
    },
    "keys": {  # chart-made keys, a LoadBalancer, an existing service account, longer drains
        "secrets": {"create": {"apiKey": API_KEY, "adminApiKey": ADMIN_KEY}},
        "router": {"replicas": 2, "service": {"type": "LoadBalancer", "port": 443}, "drainSeconds": 900,
                   "extraArgs": ["--policy", "cache_aware"], "nodeSelector": {"pool": "cpu"}},
        "serviceAccount": {"create": False, "name": "pdserve-discovery"},
        "shutdown": {"preStopSeconds": 20, "gracefulShutdownSeconds": 120, "marginSeconds": 10},
        "ports": {"http": 8000, "bootstrap": 9000},
    },
}
POD_IP = "10.1.2.3"  # what the kubelet puts in $(POD_IP)


@pytest.fixture(scope="module", params=list(VALUE_SETS))
def chart(request: pytest.FixtureRequest) -> tuple[str, Rendered]:
    return request.param, render_chart(VALUE_SETS[request.param])


def expanded_args(container: dict[str, Any]) -> list[str]:
    env = {e["name"]: e for e in container.get("env", [])}
    if any("$(POD_IP)" in a for a in container["args"]):
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    return [a.replace("$(POD_IP)", POD_IP) for a in container["args"]]


def worker_args(r: Rendered, role: str) -> Any:
    return parse_server_args(expanded_args(r.container(role)), disaggregation_mode=role)


def router_config(r: Rendered) -> RouterConfig:
    c = r.container("router")
    assert c["command"][:2] == ["/bin/sh", "-c"] and 'exec python -m router "$@"' in c["command"][2]
    return RouterConfig.from_args(c["args"])


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_helm_lint_strict(kube_version: str) -> None:
    for values in VALUE_SETS.values():
        report = lint_chart(values, f"v{kube_version}")
        assert not report["errors"] and not [m for m in report["messages"] if m["severity"] >= 2], report
    broken = lint_chart({"probes": {"periodSeconds": 0}}, f"v{kube_version}")  # a template error: lint says so
    assert broken["errors"] or [m for m in broken["messages"] if m["severity"] >= 2], broken


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_every_object_validates_strict(chart: tuple[str, Rendered], kube_version: str) -> None:
    _, r = chart
    kinds = {o["kind"] for o in r.objects}
    assert {"Deployment", "Service", "ServiceAccount", "Role", "RoleBinding", "PodDisruptionBudget"} <= kinds \
        or (chart[0] == "keys" and "ServiceAccount" not in kinds)
    for obj in r.objects:
        kubernetes_validate.validate(obj, kube_version, strict=True)  # raises ValidationError


def test_strict_validation_rejects_a_misspelt_field() -> None:
    r = render_chart()
    bad = r.deployment("decode")
    bad["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBE_VERSIONS[0], strict=True)


def test_selectors_match_pod_labels(chart: tuple[str, Rendered]) -> None:
    _, r = chart
    roles = ("prefill", "decode", "router")
    for role in roles:
        d = r.deployment(role)
        assert d["spec"]["selector"]["matchLabels"].items() <= r.pod_labels(role).items()
    (svc,) = r.of_kind("Service")
    assert [role for role in roles if svc["spec"]["selector"].items() <= r.pod_labels(role).items()] == ["router"]
    pdbs = {p["metadata"]["name"]: p for p in r.of_kind("PodDisruptionBudget")}
    assert len(pdbs) == 3
    for pdb in pdbs.values():
        sel = pdb["spec"]["selector"]["matchLabels"].items()
        assert len([role for role in roles if sel <= r.pod_labels(role).items()]) == 1, pdb
    # the router's discovery selectors pick exactly their role's pods
    cfg = router_config(r)
    for role, selector in (("prefill", cfg.prefill_selector), ("decode", cfg.decode_selector)):
        assert [x for x in roles if dict(selector).items() <= r.pod_labels(x).items()] == [role]
    assert cfg.service_discovery and cfg.service_discovery_namespace == NAMESPACE


def test_flags_parse_and_agree(chart: tuple[str, Rendered]) -> None:
    name, r = chart
    values = VALUE_SETS[name]
    prefill, decode, cfg = worker_args(r, "prefill"), worker_args(r, "decode"), router_config(r)
    assert prefill.host == decode.host == POD_IP  # each pod serves (and publishes its bootstrap) on its own IP
    assert prefill.port == decode.port == cfg.service_discovery_port
    prefill_pod = r.deployment("prefill")["spec"]["template"]["metadata"]
    assert prefill_pod["annotations"][cfg.bootstrap_port_annotation] == str(prefill.disaggregation_bootstrap_port)
    ports = {p["name"]: p["containerPort"] for p in r.container("prefill")["ports"]}
    assert ports == {"http": prefill.port, "bootstrap": prefill.disaggregation_bootstrap_port}
    assert cfg.host == "0.0.0.0" and cfg.cluster_secret_file and prefill.cluster_secret_file
    assert cfg.model_path == prefill.model_path == decode.model_path
    assert cfg.service_discovery_resync == 30.0
    if "extraArgs" in values.get("router", {}):
        assert cfg.prefill_policy == cfg.decode_policy == "cache_aware"
    assert r.deployment("prefill")["spec"]["replicas"] == values.get("prefill", {}).get("replicas", 1)
    assert r.deployment("decode")["spec"]["replicas"] == values.get("decode", {}).get("replicas", 1)


def test_probe_paths_exist_in_the_route_tables(chart: tuple[str, Rendered]) -> None:
    _, r = chart
    routes = {"router": {x.path for x in ROUTER_ROUTES if x.method == "GET"},
              "worker": {x.path for x in INSTANCE_ROUTES if x.method == "GET"}}
    for role in ("prefill", "decode", "router"):
        c = r.container(role)
        table = routes["router" if role == "router" else "worker"]
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            get = c[probe]["httpGet"]
            assert get["path"] in table, (role, probe, get)
            assert get["port"] in {p["name"] for p in c["ports"]}
            assert c[probe]["timeoutSeconds"] > 1  # the servers answer /health within 0.25 s
        assert c["livenessProbe"]["httpGet"]["path"] != "/health" or role != "router"  # router /health = ready
        start = c["startupProbe"]
        assert start["periodSeconds"] * start["failureThreshold"] >= 600  # a model load


def test_secrets_only_as_mounted_files(chart: tuple[str, Rendered]) -> None:
    name, r = chart
    secret_name = VALUE_SETS[name].get("secrets", {}).get("existingSecret") or f"{RELEASE}-pdserve-secrets"
    for role in ("prefill", "decode", "router"):
        spec = r.pod_spec(r.deployment(role))
        vols = {v["name"]: v for v in spec["volumes"]}
        assert all(v["secret"]["secretName"] == secret_name for v in vols.values() if "secret" in v)
        secret_vol = vols["secrets"]
        for c in spec["containers"] + spec.get("initContainers", []):
            assert "envFrom" not in c
            for e in c.get("env", []):
                assert "secretKeyRef" not in e.get("valueFrom", {}), e
            mounts = {m["name"]: m for m in c["volumeMounts"]}
            assert all(mounts[n]["readOnly"] is True for n in mounts if "secret" in vols[n]), c["name"]
        main = spec["containers"][0]
        mount = {m["name"]: m for m in main["volumeMounts"]}[secret_vol["name"]]["mountPath"]
        flags = [a for a in main["args"] if a.startswith("--cluster-secret-file=")]
        assert not [a for a in main["args"] if re.match(r"--(admin-)?api-key(=|$)", a)]
        if role != "router":
            assert flags == [f"--cluster-secret-file={mount}/cluster-secret"]
            continue
        # L6: the router container holds derived keys only; the cluster secret reaches only the
        # init container that derives them
        assert flags == ["--cluster-secret-file=/var/run/pdserve/router-keys/router_keys"]
        assert [i["key"] for i in secret_vol["secret"]["items"]] == ["api-key", "admin-api-key"]
        holders = [c["name"] for c in spec["containers"] + spec.get("initContainers", [])
                   if any(m["name"] == "cluster-secret" for m in c["volumeMounts"])]
        assert holders == ["router-keys"] and vols["router-keys"]["emptyDir"]["medium"] == "Memory"
    text = repr([o for o in r.objects if o["kind"] != "Secret"])
    assert API_KEY not in text and ADMIN_KEY not in text
    secrets = r.of_kind("Secret")
    if name == "gpu":
        assert not secrets  # the operator's own Secret
    else:
        (s,) = secrets
        assert "cluster-secret" in s["data"]
        assert ("api-key" in s["data"]) == (name == "keys")


def test_grace_period_covers_prestop_and_drain(chart: tuple[str, Rendered]) -> None:
    _, r = chart
    for role in ("prefill", "decode", "router"):
        spec = r.pod_spec(r.deployment(role))
        c = spec["containers"][0]
        pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
        drain = router_config(r).request_timeout if role == "router" else worker_args(r, role).graceful_shutdown_timeout
        assert pre_stop > 0
        assert spec["terminationGracePeriodSeconds"] >= pre_stop + drain + 5, (role, spec["terminationGracePeriodSeconds"])


def test_gpus_only_when_asked(chart: tuple[str, Rendered]) -> None:
    name, r = chart
    for role in ("prefill", "decode"):
        gpus = VALUE_SETS[name].get(role, {}).get("gpus", 0)
        c = r.container(role)
        args = worker_args(r, role)
        limits = c.get("resources", {}).get("limits", {})
        if gpus:
            assert limits["nvidia.com/gpu"] == gpus and args.device == "cuda" and args.tp_size == gpus
        else:
            assert "nvidia.com/gpu" not in repr(c["resources"]) and args.device == "cpu"
    assert "nvidia.com/gpu" not in repr(r.container("router")["resources"])


def test_discovery_rbac_is_pods_read_only(chart: tuple[str, Rendered]) -> None:
    name, r = chart
    sa = r.pod_spec(r.deployment("router"))["serviceAccountName"]
    for role in ("prefill", "decode"):
        assert r.pod_spec(r.deployment(role))["automountServiceAccountToken"] is False
    if name == "keys":
        assert sa == "pdserve-discovery" and not r.of_kind("Role")
        return
    (role_obj,), (binding,) = r.of_kind("Role"), r.of_kind("RoleBinding")
    assert role_obj["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert binding["roleRef"]["name"] == role_obj["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}]


@pytest.mark.parametrize("bad", [{"prefill": {"gpus": -1}}, {"probes": {"periodSeconds": 0}},
                                 {"shutdown": {"marginSeconds": 0}}, {"ports": {"http": 70000}},
                                 {"router": {"service": {"type": "Ingress"}}}, {"decode": {"replicas": "2"}}])
def test_the_values_schema_refuses_broken_values(bad: dict[str, Any]) -> None:
    import helm_python

    with pytest.raises(helm_python.HelmError):
        render_chart(bad)


def test_every_value_has_a_one_line_comment() -> None:
    missing = []
    for n, line in enumerate((CHART / "values.yaml").read_text().splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        key, _, rest = stripped.partition(":")
        if rest.strip() == "":  # a mapping header: its children carry the comments
            continue
        if "  # " not in line:
            missing.append(f"{n}: {line}")
    assert not missing, missing
