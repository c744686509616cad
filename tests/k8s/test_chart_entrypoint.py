"""The router container's entrypoint exactly as the chart renders it: it reads the API keys from the
mounted Secret files into the router's own environment, so they work and are on no command line."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from common.cluster_secret import RouterKeys
from tests.harness.process import ChildProcess, free_port
from tests.k8s.chart import render_chart
from tests.pd.pd_procs import REPO_ROOT

pytest.importorskip("helm_python", reason="helm-python-sdk ships libhelm_c for linux x86_64 only")

API_KEY, ADMIN_KEY = "sk-entry-client-5e1f", "sk-entry-admin-90c2"


def test_router_entrypoint_reads_keys_from_the_mounted_files(tiny_llama_path: str, tmp_path: Path) -> None:
    r = render_chart({"secrets": {"mountPath": "/etc/pdserve/secrets",
                                  "create": {"apiKey": API_KEY, "adminApiKey": ADMIN_KEY}}})
    command = r.container("router")["command"]
    assert command[:2] == ["/bin/sh", "-c"]
    keys = tmp_path / "secrets"  # what the kubelet mounts from the Secret
    keys.mkdir()
    for name, value in (("api-key", API_KEY), ("admin-api-key", ADMIN_KEY), ("cluster-secret", secrets.token_hex(24))):
        (keys / name).write_text(value)
    # the router-keys init container, as rendered: the router gets derived keys, never the secret
    (init,) = [c for c in r.pod_spec(r.deployment("router"))["initContainers"] if c["name"] == "router-keys"]
    derived = tmp_path / "router-keys"
    derived.mkdir()
    init_script = init["command"][2].replace("/var/run/pdserve/cluster", str(keys)).replace(
        "/var/run/pdserve/router-keys", str(derived))
    path_env = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    subprocess.run([*init["command"][:2], init_script], env={**os.environ, **path_env}, cwd=REPO_ROOT, check=True,
                   timeout=60)
    assert (derived / "router_keys").stat().st_mode & 0o077 == 0
    assert RouterKeys.decode((derived / "router_keys").read_bytes()) is not None
    script = command[2].replace("/etc/pdserve/secrets", str(keys))
    port = free_port()
    argv = [*command[:2], script, *command[3:], "--model-path", tiny_llama_path, "--port", str(port),
            "--cluster-secret-file", str(derived / "router_keys"), "--log-level", "warning",
            "--prefill", f"http://127.0.0.1:{free_port()}", "1", "--decode", f"http://127.0.0.1:{free_port()}"]
    env = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PDSERVE_API_KEY": "", "PDSERVE_ADMIN_API_KEY": ""}
    child = ChildProcess(argv, "router-entrypoint", env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        child.wait_http(url + "/metrics", 60.0)
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
        assert httpx.get(url + "/workers", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 401
        assert httpx.get(url + "/workers", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).status_code == 200
        cmdline = Path(f"/proc/{child.pid}/cmdline").read_bytes().decode()  # sh exec'd python: same pid
        assert "router" in cmdline and API_KEY not in cmdline and ADMIN_KEY not in cmdline
    finally:
        child.close()
