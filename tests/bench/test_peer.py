"""bench/peer.py end to end: one run over three kinds of system, then the unit rules of its output.

The run (one peer.py process, tiny workloads, the tiny llama in float32):
    colocated  launch:colocated      our colocated instance through launch/pd.sh, started and stopped by peer.py
    vllm       url:<fake server>     tests/bench/fake_openai_server.py, already running (a stand-in peer)
    pd         cmd:<exits at once>   a system that never serves: nulls and its reason, not a crash
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from peer_client import Figures, Outcome
from peer_report import RATIOS, SystemResult, result
from peer_systems import SystemSpec, command_url

from tests.bench.bench_fakes import BENCH, HERE, REPO, FakeServer
from tests.harness.process import ChildProcess, free_port, http_ok
from tests.launch.pd_launch import group_alive

PROMPTS = 4
INPUT_LEN = 16
OUTPUT_LEN = 6
CONCURRENCY = 2


class PeerRun(NamedTuple):
    proc: subprocess.CompletedProcess[str]
    result: dict[str, Any]
    log_dir: Path
    fake: FakeServer

    def context(self) -> str:
        return self.proc.stdout[-4000:] + self.proc.stderr[-4000:]


@pytest.fixture(scope="module")
def peer_run(tiny_llama_path: str, fake_server: Any, tmp_path_factory: pytest.TempPathFactory) -> PeerRun:
    fake = fake_server("peer_vllm")
    fake.control(ttft_ms=30, itl_ms=10)
    log_dir = tmp_path_factory.mktemp("peer")
    argv = [sys.executable, str(BENCH / "peer.py"), "--model-path", tiny_llama_path, "--dtype", "float32",
            "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN), "--b1-prompts", str(PROMPTS),
            "--c16-prompts", str(PROMPTS), "--c16-concurrency", str(CONCURRENCY), "--warmup", "1",
            "--ready-timeout", "240", "--stop-timeout", "20", "--client-timeout", "300", "--log-dir", str(log_dir),
            "--system", "colocated=launch:colocated", "--system", f"vllm=url:{fake.url}",
            "--system", "pd=cmd:echo no such server >&2; exit 3 # --port {port}"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=REPO)
    last = (proc.stdout.rstrip("\n").splitlines() or [""])[-1]
    assert last.startswith("RESULT "), proc.stdout[-4000:] + proc.stderr[-4000:]
    return PeerRun(proc, json.loads(last.removeprefix("RESULT ")), log_dir, fake)


def test_every_system_measured_or_explained(peer_run: PeerRun) -> None:
    res = peer_run.result
    assert peer_run.proc.returncode == 1, peer_run.context()  # a system failed: not a clean run
    assert res["systems"] == ["colocated", "vllm", "pd"]
    for name in ("colocated", "vllm"):
        for w in ("b1", "c16"):
            for m in ("out_tok_s", "ttft_p50_ms", "tpot_ms", "itl_p99_ms"):
                assert res[f"{name}_{w}_{m}"] is not None and res[f"{name}_{w}_{m}"] > 0, (name, w, m)
            assert f"{name}_{w}" not in res["errors"], peer_run.context()
    # the failed system: every figure null, one reason with its own words in it
    assert all(res[f"pd_{w}_{m}"] is None for w in ("b1", "c16") for m in ("out_tok_s", "tpot_ms"))
    assert set(res["errors"]) == {"pd"}
    assert "exited with 3" in res["errors"]["pd"] and "no such server" in res["errors"]["pd"]
    assert "pd:" in peer_run.proc.stdout and "did not start" in peer_run.proc.stdout  # in the table too


def test_ratios_come_from_the_measured_figures(peer_run: PeerRun) -> None:
    res = peer_run.result
    assert res["colocated_vs_vllm_c16_tput"] == round(res["colocated_c16_out_tok_s"] / res["vllm_c16_out_tok_s"], 4)
    assert res["colocated_vs_vllm_b1_tpot"] == round(res["colocated_b1_tpot_ms"] / res["vllm_b1_tpot_ms"], 4)
    assert res["pd_vs_colocated_c16_tput"] is None and res["pd_vs_colocated_c16_itl_p99"] is None
    goals = res["goals"]
    assert goals["pd_vs_colocated_c16_tput>=0.9"] is None
    assert goals["colocated_vs_vllm_c16_tput>=1.1"] == (res["colocated_vs_vllm_c16_tput"] >= 1.1)
    # the stand-in's figures are its own: at least its 10 ms gap per token and 30 ms to the first
    assert res["vllm_b1_tpot_ms"] >= 9.0 and res["vllm_b1_ttft_p50_ms"] >= 29.0


def test_the_same_workload_reached_the_peer(peer_run: PeerRun) -> None:
    stats = peer_run.fake.stats()
    # one warmup per workload, then every prompt, all served
    assert stats["requests"] == 2 * (1 + PROMPTS), stats["requests"]
    assert stats["ok"] == stats["requests"]


def test_started_systems_are_stopped(peer_run: PeerRun) -> None:
    pids = peer_run.log_dir / "colocated" / "pids"
    roles = [line.split() for line in pids.read_text().splitlines()]
    assert sorted(r[0] for r in roles) == ["colocated-0", "router"], roles
    assert not [r for r in roles if group_alive(int(r[2]))], roles
    endpoints = peer_run.result["endpoints"]
    assert endpoints["pd"] is None and endpoints["vllm"] == peer_run.fake.url
    assert not http_ok(endpoints["colocated"] + "/v1/models", status=None, timeout_s=2.0)


def test_sigterm_stops_the_running_system(tiny_llama_path: str, tmp_path: Path) -> None:
    """peer.py killed mid-run takes the system it started down with it (no server left on its port)."""
    port = free_port()
    server = f"{sys.executable} {HERE / 'fake_openai_server.py'} --port {port} --model-path {{model}}"
    argv = [sys.executable, str(BENCH / "peer.py"), "--model-path", tiny_llama_path, "--log-dir", str(tmp_path),
            "--b1-prompts", "1000", "--ready-timeout", "60", "--stop-timeout", "10", "--system", f"fake=cmd:{server}"]
    peer = ChildProcess(argv, "peer", pythonpath=None)
    url = f"http://127.0.0.1:{port}/v1/models"
    try:
        peer.wait_http(url, 60.0)
        assert peer.popen is not None
        peer.popen.send_signal(signal.SIGTERM)
        assert peer.popen.wait(30) == 128 + signal.SIGTERM, peer.log()
        assert not http_ok(url, status=None, timeout_s=2.0), peer.log()
    finally:
        peer.close()


def test_spec_parsing() -> None:
    assert SystemSpec.parse("colocated=launch:colocated").launch_flags() == ["--colocated", "1"]
    assert SystemSpec.parse("pd=launch:pd").launch_flags() == []
    assert SystemSpec.parse("x=launch:--colocated 1 --env A=B").launch_flags() == ["--colocated", "1", "--env", "A=B"]
    spec = SystemSpec.parse("v=cmd:python -m vllm --port 9 x=y")
    assert (spec.kind, spec.arg) == ("cmd", "python -m vllm --port 9 x=y")
    for bad in ("colocated", "a=launch:", "a b=url:http://x", "1a=url:http://x", "a=ssh:host"):
        with pytest.raises(ValueError):
            SystemSpec.parse(bad)
    assert command_url("vllm serve --host 0.0.0.0 --port 8123") == "http://127.0.0.1:8123"
    assert command_url("vllm serve") == "http://127.0.0.1:8000"


def figures(tput: float, tpot: float, itl_p99: float) -> Figures:
    return Figures(completed=4, duration=1.0, output_throughput=tput, median_ttft_ms=50.0, p99_ttft_ms=60.0,
                   median_tpot_ms=tpot, median_itl_ms=tpot, p99_itl_ms=itl_p99, total_output_tokens=24)


def test_result_ratios_and_goals() -> None:
    systems = [SystemResult("colocated", "launch:colocated", {"b1": Outcome(figures(60, 12.0, 20)),
                                                              "c16": Outcome(figures(400, 30, 50))}),
               SystemResult("pd", "launch:pd", {"b1": Outcome(figures(55, 13.0, 20)),
                                                "c16": Outcome(figures(380, 30, 60))}),
               SystemResult("vllm", "cmd:vllm", {"b1": Outcome(figures(70, 15.0, 20)),
                                                 "c16": Outcome(None, "2 of 4 requests failed")})]
    res = result(systems, ["b1", "c16"])
    assert res["pd_vs_colocated_c16_tput"] == 0.95 and res["pd_vs_colocated_c16_itl_p99"] == 1.2
    assert res["colocated_vs_vllm_b1_tpot"] == 0.8 and res["colocated_vs_vllm_c16_tput"] is None
    assert res["colocated_b1_tpot_ms"] == 12.0 and res["vllm_b1_tpot_ms"] == 15.0
    assert res["goals"] == {"colocated_vs_vllm_c16_tput>=1.1": None, "colocated_vs_vllm_b1_tpot<=0.9": True,
                            "pd_vs_colocated_c16_tput>=0.9": True, "pd_vs_colocated_c16_itl_p99<=1.0": False}
    assert res["errors"] == {"vllm_c16": "2 of 4 requests failed"}
    assert {r.key for r in RATIOS} <= set(res)
