"""launch/pd.sh across three "hosts" (network namespaces) through the exec-prefix hook.

Router, prefill and decode each run in their own namespace with UCX_TLS=tcp, so the KV
pages travel over TCP across the veth links as they would between machines. Every packet
to a lab address is sent from inside a lab namespace; the root namespace only runs pd.sh,
whose health checks go through the same hook (see tests/launch/netns_lab.py).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.launch.netns_lab import NetnsLab, lab_or_skip
from tests.launch.pd_launch import PdLaunch

ROUTER, PREFILL, DECODE = 0, 1, 2
API_KEY = "sk-multinode-test"
PORTS = {"router": 30000, "prefill": 30100, "bootstrap": 8998, "decode": 30200}

CHAT = """
import json, sys, openai
client = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key=sys.argv[3], timeout=120.0, max_retries=0)
out = client.chat.completions.create(model=sys.argv[2], messages=[{"role": "user", "content": "hi " * 40}],
                                     max_tokens=5, temperature=0)
print(json.dumps({"finish": out.choices[0].finish_reason, "tokens": out.usage.completion_tokens}))
"""


@pytest.fixture
def lab() -> Iterator[NetnsLab]:
    yield from lab_or_skip(3)


def metric(lab: NetnsLab, host: int, port: int, name: str) -> float:
    url = f"http://{lab.addr(host)}:{port}/metrics"
    res = lab.run_in(lab.addr(host), ["curl", "-sf", "--noproxy", "*", "-m", "10", url])
    assert res.returncode == 0, res.stderr
    return sum(
        float(line.split()[-1])
        for line in res.stdout.splitlines()
        if line.startswith(f"pdserve_{name}") and not line.startswith("#")
    )


def test_pd_sh_runs_roles_on_three_hosts_and_moves_kv_over_tcp(
    lab: NetnsLab, tiny_llama_path: str, tmp_path: Path
) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text(
        f"router {lab.addr(ROUTER)} {PORTS['router']}\n"
        f"prefill {lab.addr(PREFILL)} {PORTS['prefill']} {PORTS['bootstrap']}\n"
        f"decode {lab.addr(DECODE)} {PORTS['decode']}\n"
    )
    key_file = tmp_path / "api_key"  # a router on a non-loopback address needs a client key
    key_file.write_text(API_KEY)
    key_file.chmod(0o600)
    run = PdLaunch(
        [
            "--api-key-file",
            str(key_file),
            "--hosts",
            str(hosts),
            "--exec-prefix-template",
            lab.exec_prefix_template,
            "--model-path",
            tiny_llama_path,
            "--dtype",
            "float32",
            "--instance-args",
            "--device cpu --max-total-tokens 2048 --log-level warning",
            "--env",
            "UCX_TLS=tcp",
            "--env",
            "UCX_TCP_USER_TIMEOUT=5s",
        ],
        tmp_path / "logs",
    )
    try:
        run.wait_ready()
        assert {r.name: r.host for r in run.roles()} == {
            "prefill-0": lab.addr(PREFILL),
            "decode-0": lab.addr(DECODE),
            "router": lab.addr(ROUTER),
        }
        # every host got the launch's secret (0600) and the workers require it of anyone else
        assert (tmp_path / "logs" / "cluster_secret").stat().st_mode & 0o777 == 0o600
        for host, port in ((PREFILL, PORTS["prefill"]), (DECODE, PORTS["decode"])):
            url = f"http://{lab.addr(host)}:{port}/server_info"
            code = lab.run_in(lab.addr(ROUTER), ["curl", "-s", "--noproxy", "*", "-m", "10", "-o", "/dev/null",
                                                  "-w", "%{http_code}", url]).stdout
            assert code == "401", (host, code)
        # the router's readiness probe already moved some KV: measure from here
        kv_before = metric(lab, PREFILL, PORTS["prefill"], "kv_transfer_bytes")
        tx_before = lab.tx_bytes(PREFILL)

        res = lab.run_in(
            lab.addr(ROUTER),
            [sys.executable, "-c", CHAT, f"http://{lab.addr(ROUTER)}:{PORTS['router']}", tiny_llama_path,
             API_KEY],
            timeout_s=180,
        )
        assert res.returncode == 0, res.stderr[-3000:]
        assert json.loads(res.stdout.splitlines()[-1]) == {"finish": "length", "tokens": 5}

        kv_moved = metric(lab, PREFILL, PORTS["prefill"], "kv_transfer_bytes") - kv_before
        tx_moved = lab.tx_bytes(PREFILL) - tx_before
        assert kv_moved > 0
        assert tx_moved > kv_moved, (tx_moved, kv_moved)  # the KV left the prefill host through its veth

        assert run.stop() == 143
        assert run.live_groups() == []
        assert not (tmp_path / "logs" / "cluster_secret").exists(), "pd.sh left the secret behind"
        for i in (ROUTER, PREFILL, DECODE):
            listening = lab.run_in(lab.addr(i), ["ss", "-Htln"]).stdout
            assert listening.strip() == "", (lab.addr(i), listening)
    finally:
        run.kill_leftovers()
