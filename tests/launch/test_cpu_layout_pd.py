"""launch/pd.sh on one host partitions the CPUs: 1P1D on the tiny model, every thread of each
engine process confined to its own CPUs (read from /proc), the two sets disjoint, the layout
printed at start. Works on a 2-core box (one CPU each)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import httpx

from common.cpu_layout import parse_cpu_list
from tests.launch.pd_launch import PD_SH, PdLaunch
from tests.launch.test_pd_launch_local import local_args, local_ports

LAYOUT_RE = re.compile(r"core layout on 127\.0\.0\.1: prefill-0 cpus (\S+) \((\d+) threads?\), "
                       r"decode-0 cpus (\S+) \((\d+) threads?\), router/frontends: (\S+)")


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def engine_pid(frontend_pid: int) -> int:
    """The instance's engine: the frontend's multiprocessing-spawned child (not its resource tracker)."""
    engines = [c for c in _children(frontend_pid)
               if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(engines) == 1, engines
    return engines[0]


def thread_cpus(pid: int) -> dict[int, tuple[int, ...]]:
    """tid -> the CPUs that thread may run on (Cpus_allowed_list of /proc/PID/task/TID/status)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:
            continue  # the thread ended meanwhile
        line = next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list:"))
        out[int(task.name)] = parse_cpu_list(line.split(":", 1)[1])
    return out


def environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().split("=", 1) for e in entries if b"=" in e)


def test_pd_sh_gives_each_engine_disjoint_cpus(tiny_llama_path: str, tmp_path: Path,
                                                launches: list[PdLaunch]) -> None:
    allowed = set(os.sched_getaffinity(0))
    assert len(allowed) >= 2, "needs 2 CPUs"
    ports = local_ports()
    run = PdLaunch(local_args(tiny_llama_path, ports), tmp_path / "logs")
    launches.append(run)
    run.wait_ready()
    m = LAYOUT_RE.search(run.output())
    assert m is not None, run.output()[-3000:]
    cpus = {"prefill-0": set(parse_cpu_list(m[1])), "decode-0": set(parse_cpu_list(m[3]))}
    assert int(m[2]) == len(cpus["prefill-0"]) and int(m[4]) == len(cpus["decode-0"])
    assert cpus["prefill-0"] and cpus["decode-0"] and not cpus["prefill-0"] & cpus["decode-0"]
    assert cpus["prefill-0"] | cpus["decode-0"] <= allowed
    assert "WARNING" not in run.output()

    # a request through the router makes both engines run forward steps (the worker thread
    # starts its OpenMP pool then): their threads must be confined before and after
    router = f"http://127.0.0.1:{ports['--port']}"
    engines = {r.name: engine_pid(r.pid) for r in run.roles() if r.name in cpus}
    assert set(engines) == set(cpus)
    for check in ("at start", "after a request"):
        if check == "after a request":
            r = httpx.post(router + "/generate", json={"input_ids": [1, 2, 3, 4],
                                                       "sampling_params": {"max_new_tokens": 4}}, timeout=120)
            assert r.status_code == 200, r.text
        for name, pid in engines.items():
            threads = thread_cpus(pid)
            assert len(threads) > 1, (name, threads)
            wrong = {tid: c for tid, c in threads.items() if set(c) != cpus[name]}
            assert not wrong, f"{name} ({check}): threads off its CPUs {sorted(cpus[name])}: {wrong}"
            assert environ(pid)["OMP_NUM_THREADS"] == str(len(cpus[name]))
    for r in run.roles():
        if r.name in cpus:
            cmdline = Path(f"/proc/{r.pid}/cmdline").read_bytes().split(b"\0")
            assert b"--cpu-omp-threads-bind" in cmdline
    assert run.stop() == 143  # SIGTERM: pd.sh stopped every role


def _dry_run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # pd.sh hands PDSERVE_*, UCX_* and NIXL_* variables on to every role (`exec env K=V ...`): left
    # out here, so the commands compared below do not depend on the caller's environment (the suite
    # runner sets PDSERVE_TEST_START_LOG)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDSERVE_", "UCX_", "NIXL_"))}
    return subprocess.run(["bash", str(PD_SH), "--dry-run", "--model-path", "/m", "--log-dir", str(tmp_path / "l"),
                           *args], capture_output=True, text=True, timeout=60, env=env)


def test_hosts_file_cpus_place_engines_router_and_frontends(tmp_path: Path) -> None:
    # both engines on CPU 0 (asked for: warned, used), the router on 1, so 1 is spare: the
    # frontends run there too
    hosts = tmp_path / "hosts"
    hosts.write_text("prefill 127.0.0.1 cpus=0\ndecode 127.0.0.1 31000 cpus=0\nrouter 127.0.0.1 cpus=1\n")
    res = _dry_run(tmp_path, "--hosts", str(hosts))
    assert res.returncode == 0, res.stderr
    assert "pd.sh: WARNING: core layout on 127.0.0.1: prefill-0 and decode-0 share CPUs 0" in res.stderr
    assert ("core layout on 127.0.0.1: prefill-0 cpus 0 (1 thread), decode-0 cpus 0 (1 thread), "
            "router/frontends: 1\n") in res.stderr
    lines = res.stdout.splitlines()
    cmds = {line.split()[0]: lines[k + 1] for k, line in enumerate(lines) if " via: " in line}
    for role in ("prefill-0", "decode-0"):
        assert "exec env taskset -c 1 " in cmds[role] and " --cpu-omp-threads-bind 0 " in cmds[role], cmds[role]
    assert "exec env taskset -c 1 " in cmds["router"] and "--cpu-omp-threads-bind" not in cmds["router"]


def test_cpus_per_instance_zero_and_gpus_bind_nothing(tmp_path: Path) -> None:
    for flags in (("--cpus-per-instance", "0"), ("--gpus-per-host", "2")):
        res = _dry_run(tmp_path, *flags)
        assert res.returncode == 0, res.stderr
        assert "core layout" not in res.stderr and "--cpu-omp-threads-bind" not in res.stdout
        assert "taskset" not in res.stdout


def test_cpus_per_instance_beyond_the_host_warns(tmp_path: Path) -> None:
    n = len(os.sched_getaffinity(0))
    res = _dry_run(tmp_path, "--cpus-per-instance", str(n))
    assert res.returncode == 0, res.stderr
    assert f"2 engines x {n} CPUs > the {n} CPUs available" in res.stderr
    assert "prefill-0 and decode-0 share CPUs" in res.stderr


def test_bad_cpus_are_refused(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("prefill 127.0.0.1 cpus=0-x\ndecode 127.0.0.1\n")
    res = _dry_run(tmp_path, "--hosts", str(hosts))
    assert res.returncode == 2 and "cpus= takes a CPU list like 0-3,8, got '0-x'" in res.stderr
    res = _dry_run(tmp_path, "--cpus-per-instance", "two")
    assert res.returncode == 2 and "--cpus-per-instance must be a non-negative integer" in res.stderr
