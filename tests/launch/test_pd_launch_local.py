"""launch/pd.sh on one host: 1P1D + router with the tiny model, a failing role, the command builder."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.launch.pd_launch import PD_SH, REPO_ROOT, PdLaunch, group_procs
from tests.server.server_procs import free_port

LIGHT_INSTANCE = "--device cpu --max-total-tokens 2048 --log-level warning"


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def local_ports() -> dict[str, int]:
    return {name: free_port() for name in ("--port", "--prefill-port", "--decode-port", "--bootstrap-port")}


def local_args(model: str, ports: dict[str, int], *extra: str) -> list[str]:
    args = ["--model-path", model, "--dtype", "float32", "--instance-args", LIGHT_INSTANCE]
    for flag, port in ports.items():
        args += [flag, str(port)]
    return args + list(extra)


def test_pd_sh_serves_openai_and_sigterm_stops_everything(
    tiny_llama_path: str, tmp_path: Path, launches: list[PdLaunch]
) -> None:
    import openai

    ports = local_ports()
    api_key, admin_key, token = "client-key-" + "a" * 20, "admin-key-" + "b" * 20, "hf-token-" + "c" * 20
    admin_file = tmp_path / "admin.key"
    admin_file.write_text(admin_key + "\n")
    admin_file.chmod(0o600)
    run = PdLaunch(local_args(tiny_llama_path, ports, "--admin-api-key-file", str(admin_file)), tmp_path / "logs",
                   env={"PDSERVE_API_KEY": api_key, "PDSERVE_HF_TOKEN": token})
    launches.append(run)
    run.wait_ready()
    out = run.output()
    url = f"http://127.0.0.1:{ports['--port']}"
    assert f"router at {url}" in out and f"curl {url}/v1/chat/completions" in out

    # No secret on any command line pd.sh started (or its own); the keys reach only the router,
    # as 0600 files; a secret-named variable reaches every role through its environment.
    logs = tmp_path / "logs"
    secret = (logs / "cluster_secret").read_text()
    procs = group_procs({r.pid for r in run.roles()} | {run.proc.pid})
    assert len(procs) >= 4
    for pid, (cmdline, environ) in procs.items():
        for value in (secret, api_key, admin_key, token):
            assert value.encode() not in cmdline, cmdline
        if pid != run.proc.pid:  # pd.sh's own environment is where the test put the key
            assert api_key.encode() not in environ and admin_key.encode() not in environ, cmdline
    role_env = {r.name: procs[r.pid][1] for r in run.roles()}
    assert all(f"PDSERVE_HF_TOKEN={token}".encode() in e.split(b"\0") for e in role_env.values())
    for name in ("api_key", "admin_api_key", "role_secrets.env"):
        assert (logs / name).stat().st_mode & 0o777 == 0o600, name
    assert (logs / "api_key").read_text() == api_key and (logs / "admin_api_key").read_text() == admin_key
    router_cmd = procs[next(r.pid for r in run.roles() if r.name == "router")][0]
    assert b"--api-key-file\0" in router_cmd and b"--admin-api-key-file\0" in router_cmd
    assert f"--cluster-secret-file\0{logs / 'router_keys'}\0".encode() in router_cmd  # derived keys only
    assert (logs / "router_keys").stat().st_mode & 0o777 == 0o600 and secret not in (logs / "router_keys").read_text()
    assert all(b"api-key" not in procs[r.pid][0] for r in run.roles() if r.name != "router")
    assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
    assert httpx.get(url + "/workers", timeout=10, headers={"Authorization": f"Bearer {admin_key}"}).status_code == 200

    client = openai.OpenAI(base_url=url + "/v1", api_key=api_key, timeout=120.0, max_retries=0)
    chat = client.chat.completions.create(
        model=tiny_llama_path,
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=6,
        temperature=0,
    )
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage is not None and chat.usage.completion_tokens == 6
    text = client.completions.create(
        model=tiny_llama_path, prompt="one two three", max_tokens=4, temperature=0
    )
    assert text.usage is not None and text.usage.completion_tokens == 4

    # Secure with no extra flag: one secret per launch, 0600, on no command line; workers need it.
    secret_file = tmp_path / "logs" / "cluster_secret"
    assert secret_file.stat().st_mode & 0o777 == 0o600
    assert len(secret) == 64
    ps = subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True, text=True, timeout=30).stdout
    assert secret not in ps and str(secret_file) in ps
    for port in (ports["--prefill-port"], ports["--decode-port"]):
        r = httpx.post(f"http://127.0.0.1:{port}/generate", json={"input_ids": [1, 2]}, timeout=10)
        assert r.status_code == 401, r.text

    roles = run.roles()
    assert sorted(r.name for r in roles) == ["decode-0", "prefill-0", "router"]
    assert all(r.log.is_file() and r.log.parent == tmp_path / "logs" for r in roles)
    assert len(run.live_groups()) == 3

    t0 = time.monotonic()
    assert run.stop() == 143
    assert time.monotonic() - t0 < 60
    assert run.live_groups() == []
    assert all(port_free(p) for p in ports.values()), ports
    assert "pd.sh: stopped" in run.output()
    assert not [f.name for f in logs.iterdir() if f.name in ("cluster_secret", "router_keys", "api_key",
                                                             "admin_api_key", "role_secrets.env")], \
        "a secret file outlived pd.sh"


def test_pd_sh_fails_fast_with_the_log_tail_of_a_broken_role(
    tiny_llama_path: str, tmp_path: Path, launches: list[PdLaunch]
) -> None:
    ports = local_ports()
    run = PdLaunch(
        local_args(tiny_llama_path, ports, "--decode-args", f"--model-path {tmp_path}/missing"),
        tmp_path / "logs",
    )
    launches.append(run)
    t0 = time.monotonic()
    assert run.wait_exit(120) == 1
    assert time.monotonic() - t0 < 90
    out = run.output()
    assert "decode-0 on 127.0.0.1 exited before it became healthy" in out
    assert "not a checkpoint directory" in out  # the tail of decode's own log
    assert "READY" not in out
    assert {r.name for r in run.roles()} == {"prefill-0", "decode-0"}  # the router was never started
    assert run.live_groups() == []
    assert all(port_free(p) for p in ports.values()), ports


def dry_run(*args: str) -> str:
    """pd.sh --dry-run's output, from an environment without the UCX_/NIXL_/PDSERVE_ variables
    pd.sh passes on (a developer's PDSERVE_TEST_KEEP_LOGS=1 would show in every command)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UCX_", "NIXL_", "PDSERVE_"))}
    res = subprocess.run(
        ["bash", str(PD_SH), "--dry-run", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30, env=env
    )
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_ssh_and_exec_hook_run_the_same_role_command(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text(
        "# role host [port] [bootstrap_port]\nrouter 10.9.0.1 8000\nprefill 10.9.0.2\n"
        "prefill 10.9.0.3 9000 9100\n\ndecode 10.9.0.4  # comment\n"
    )
    common = [
        "--hosts",
        str(hosts),
        "--model-path",
        "/models/m",
        "--log-dir",
        str(tmp_path / "logs"),
        "--env",
        "UCX_TLS=tcp",
        "--page-size",
        "32",
        "--prefill-args",
        "--chunked-prefill-size 64",
    ]
    over_ssh = dry_run(*common).splitlines()
    over_netns = dry_run(*common, "--exec-prefix-template", "ip netns exec lab-{host}").splitlines()
    assert over_ssh[0] == "prefill-0 10.9.0.2 via: ssh -o BatchMode=yes -o ConnectTimeout=10 10.9.0.2 bash -s"
    assert over_netns[0] == "prefill-0 10.9.0.2 via: ip netns exec lab-10.9.0.2 bash -s"
    assert over_ssh[1::2] == over_netns[1::2]  # identical commands, only the wrapper differs
    cmds = dict(zip([line.split()[0] for line in over_ssh[::2]], over_ssh[1::2], strict=True))
    assert set(cmds) == {"prefill-0", "prefill-1", "decode-0", "router"}
    assert (
        "env UCX_TLS=tcp .venv/bin/python -m prefill_server --model-path /models/m --host 10.9.0.2 "
        "--port 30100 --disaggregation-bootstrap-port 8998 --page-size 32 --chunked-prefill-size 64"
        in cmds["prefill-0"]
    )
    assert "--host 10.9.0.3 --port 9000 --disaggregation-bootstrap-port 9100" in cmds["prefill-1"]
    assert (
        "-m decode_server --model-path /models/m --host 10.9.0.4 --port 30200 --page-size 32"
        in cmds["decode-0"]
    )
    secret = f"--cluster-secret-file {tmp_path / 'logs' / 'cluster_secret'}"
    assert cmds["decode-0"].endswith(f"--page-size 32 {secret}")
    assert cmds["router"].endswith(
        "-m router --model-path /models/m --host 10.9.0.1 --port 8000 "
        "--prefill http://10.9.0.2:30100 8998 --prefill http://10.9.0.3:9000 9100 "
        f"--decode http://10.9.0.4:30200 --cluster-secret-file {tmp_path / 'logs' / 'router_keys'}"
    )
    assert all(cmd.endswith(secret) for name, cmd in cmds.items() if name != "router")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bogus"], "unknown flag --bogus"),
        (["--port"], "--port needs a value"),
        (["--num-decode", "0"], "at least one prefill and one decode"),
        (["--port", "x1"], "--port must be a non-negative integer"),
        (["--env", "NOEQUALS"], "--env takes KEY=VALUE"),
        (["--env", "PDSERVE_API_KEY=k" * 8], "pass PDSERVE_API_KEY as a file"),
        (["--router-args", "--api-key k"], "--api-key would put the key on a command line"),
        (["--router-args", "--admin-api-key=k"], "--admin-api-key would put the key on a command line"),
    ],
)
def test_bad_flags_exit_2_before_starting_anything(args: list[str], message: str, tmp_path: Path) -> None:
    res = subprocess.run(
        ["bash", str(PD_SH), "--log-dir", str(tmp_path / "l"), *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 2 and message in res.stderr, res.stderr


def test_dry_run_names_secret_files_never_their_values(tmp_path: Path) -> None:
    key = tmp_path / "client.key"
    key.write_text("the-client-key-value")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UCX_", "NIXL_", "PDSERVE_"))}
    res = subprocess.run(
        ["bash", str(PD_SH), "--dry-run", "--model-path", "/m", "--log-dir", str(tmp_path / "l"), "--api-key-file",
         str(key), "--env", "HF_TOKEN=the-token-value"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=30,
        env={**env, "PDSERVE_ADMIN_API_KEY": "the-admin-key-value"},
    )
    assert res.returncode == 0, res.stderr
    assert "value" not in res.stdout + res.stderr
    cmds = dict(zip([line.split()[0] for line in res.stdout.splitlines()[::2]], res.stdout.splitlines()[1::2],
                    strict=True))
    assert f"--api-key-file {tmp_path}/l/api_key --admin-api-key-file {tmp_path}/l/admin_api_key" in cmds["router"]
    assert all("api-key" not in c for name, c in cmds.items() if name != "router")
    assert all(f". {tmp_path}/l/role_secrets.env" in c for c in cmds.values())


def test_bad_hosts_file_lines_are_named(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("prefill 10.9.0.2\nworker 10.9.0.3\n")
    res = subprocess.run(
        ["bash", str(PD_SH), "--hosts", str(hosts), "--dry-run"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert (
        res.returncode == 2 and f"{hosts}:2: role must be router, prefill, decode or colocated" in res.stderr
    )
    hosts.write_text("prefill 10.9.0.2\n")
    res = subprocess.run(
        ["bash", str(PD_SH), "--hosts", str(hosts), "--dry-run"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 2 and "needs a prefill and a decode line" in res.stderr


def test_help_documents_every_flag() -> None:
    res = subprocess.run(["bash", str(PD_SH), "--help"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0
    source = PD_SH.read_text()
    flags = {
        line.strip().split(")")[0]
        for line in source.splitlines()
        if line.strip().startswith("--") and ")" in line.split()[0]
    }
    assert flags, "no flags parsed from pd.sh"
    for flag in flags:
        assert flag in res.stdout, flag


def test_colocated_mode_puts_instances_behind_the_router_as_workers(tmp_path: Path) -> None:
    lines = dry_run(
        "--colocated", "2", "--model-path", "/models/m", "--log-dir", str(tmp_path / "l")
    ).splitlines()
    cmds = dict(zip([line.split()[0] for line in lines[::2]], lines[1::2], strict=True))
    assert set(cmds) == {"colocated-0", "colocated-1", "router"}
    assert "-m common.server --model-path /models/m --host 127.0.0.1 --port 30101" in cmds["colocated-1"]
    assert "--worker http://127.0.0.1:30100 --worker http://127.0.0.1:30101 --cluster-secret-file" in cmds["router"]
    hosts = tmp_path / "hosts"
    hosts.write_text("colocated 10.9.0.2\nprefill 10.9.0.3\ndecode 10.9.0.4\n")
    res = subprocess.run(
        ["bash", str(PD_SH), "--hosts", str(hosts), "--dry-run"], capture_output=True, text=True, timeout=30
    )
    assert res.returncode == 2 and "mixes colocated with prefill/decode" in res.stderr


def test_firewall_rules_name_this_launchs_hosts_and_ucx_ports(tmp_path: Path) -> None:
    """H1 (security review 2): UCX over TCP authenticates nothing, so pd.sh prints per-host nftables
    rules from its hosts file, with UCX's ports pinned (UCX_TCP_PORT_RANGE in every role's env)."""
    hosts = tmp_path / "hosts"
    hosts.write_text("router 10.9.0.1 8000\nprefill 10.9.0.2\ndecode 10.9.0.2\ndecode 10.9.0.3 9000\n")
    common = ["--hosts", str(hosts), "--model-path", "/m", "--log-dir", str(tmp_path / "logs")]
    rules = dry_run(*common, "--ucx-tcp-port-range", "41000-41099", "--firewall-rules").splitlines()
    peers = "ip saddr { 10.9.0.2, 10.9.0.3, 10.9.0.1 }"
    assert rules[0].startswith("# pdserve firewall for 10.9.0.2 (prefill-0 decode-0)")
    assert f"        tcp dport {{ 30100, 8998, 30200, 41000-41099 }} {peers} accept" in rules
    assert "        tcp dport { 30100, 8998, 30200, 41000-41099 } drop" in rules
    assert f"        tcp dport {{ 9000, 41000-41099 }} {peers} accept" in rules
    assert sum(line.startswith("table inet pdserve") for line in rules) == 2  # the router's host runs no instance
    cmds = dry_run(*common, "--ucx-tcp-port-range", "41000-41099")
    assert cmds.count("env UCX_TCP_PORT_RANGE=41000-41099 ") == 4
    res = subprocess.run(["bash", str(PD_SH), *common, "--firewall-rules"], capture_output=True, text=True, timeout=30,
                         env={k: v for k, v in os.environ.items() if not k.startswith("UCX_")})
    assert res.returncode == 2 and "needs --ucx-tcp-port-range" in res.stderr
