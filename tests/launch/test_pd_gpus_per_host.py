"""pd.sh --gpus-per-host: each instance on a host gets its own --base-gpu-id (seen in --dry-run)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.launch.pd_launch import PD_SH, REPO_ROOT


def dry_run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(PD_SH), "--dry-run", "--model-path", "/models/m", *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=30,
    )


def gpu_of_each_role(stdout: str) -> dict[str, str | None]:
    lines = stdout.splitlines()
    out: dict[str, str | None] = {}
    for head, cmd in zip(lines[::2], lines[1::2], strict=True):
        words = cmd.split()
        out[head.split()[0]] = words[words.index("--base-gpu-id") + 1] if "--base-gpu-id" in words else None
    return out


def test_single_host_instances_get_consecutive_gpus() -> None:
    res = dry_run("--gpus-per-host", "4", "--num-prefill", "2", "--num-decode", "2")
    assert res.returncode == 0, res.stderr
    assert gpu_of_each_role(res.stdout) == {
        "prefill-0": "0", "prefill-1": "1", "decode-0": "2", "decode-1": "3", "router": None,
    }
    without = dry_run("--num-prefill", "2", "--num-decode", "2")
    assert without.returncode == 0 and set(gpu_of_each_role(without.stdout).values()) == {None}


def test_gpus_are_counted_per_host(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("router 10.9.0.1\nprefill 10.9.0.2\nprefill 10.9.0.2 30101 8999\ndecode 10.9.0.3\ndecode 10.9.0.2 30201\n")
    res = dry_run("--hosts", str(hosts), "--gpus-per-host", "8")
    assert res.returncode == 0, res.stderr
    assert gpu_of_each_role(res.stdout) == {
        "prefill-0": "0", "prefill-1": "1", "decode-0": "0", "decode-1": "2", "router": None,
    }


def test_colocated_instances_get_gpus_too() -> None:
    res = dry_run("--gpus-per-host", "2", "--colocated", "2")
    assert res.returncode == 0, res.stderr
    assert gpu_of_each_role(res.stdout) == {"colocated-0": "0", "colocated-1": "1", "router": None}


def test_more_instances_than_gpus_on_a_host_is_refused() -> None:
    res = dry_run("--gpus-per-host", "1")
    assert res.returncode == 2 and "host 127.0.0.1 runs more than --gpus-per-host 1 instances" in res.stderr

