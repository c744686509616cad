"""bench/gpu/run.sh's SMOKE path on the CPU (tiny model), its failure reporting and budget, and
bench/transfer.py --device cpu (two processes, tight-polled NIXL WRITE): real processes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_bench(tmp_path: Path, *steps: str, timeout: float = 240, **env: str) -> list[str]:
    """`SMOKE=1 bash bench/gpu/run.sh STEPS` with everything under tmp_path: steps.txt's lines."""
    out = tmp_path / "out"
    full_env = dict(os.environ, SMOKE="1", PYTHON=sys.executable, OUT_DIR=str(out), LOG_DIR=str(tmp_path / "logs"),
                    MODEL=str(tmp_path / "m1b"), MODEL8=str(tmp_path / "m8b"), **env)
    subprocess.run(["bash", "bench/gpu/run.sh", *steps], cwd=REPO, env=full_env, timeout=timeout, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    assert (out / "logs.tgz").is_file()
    return (out / "steps.txt").read_text().splitlines()


def result_of(lines: list[str], step: str) -> dict[str, object]:
    (line,) = [x for x in lines if f"] {step}: " in x]
    assert " RESULT " in line, line
    return json.loads(line.split(" RESULT ", 1)[1])


def test_smoke_builds_the_tiny_model_and_measures_throughput(tmp_path: Path) -> None:
    lines = run_bench(tmp_path, "model", "throughput")
    assert "imports ok" in lines[0]
    assert any("model tiny:" in x and "shape tiny" in x for x in lines)  # gen_model's own line
    assert json.loads((tmp_path / "m1b" / "config.json").read_text())["num_hidden_layers"] == 2
    res = result_of(lines, "throughput")
    assert res["batch"] == 8 and res["new"] == 16 and float(res["engine_tok_s"]) > 0  # type: ignore[arg-type]
    assert res["streamed_weight_gb"] is not None and "hf_static_tok_s" in res
    assert lines[-1].endswith("done")


def test_a_failing_step_says_why_and_a_spent_budget_skips(tmp_path: Path) -> None:
    broken = tmp_path / "m1b"
    broken.mkdir()
    (broken / "config.json").write_text('{"vocab_size": 384}')  # no weights, no architecture
    lines = run_bench(tmp_path, "throughput", timeout=120)
    (line,) = [x for x in lines if "] throughput: " in x]
    assert "FAILED rc=1" in line and "Error" in line, line  # the log's last lines, not an empty RESULT
    lines = run_bench(tmp_path / "again", "throughput", "8b-pd", timeout=60, BUDGET_S="10")
    said = [x.split("] ", 1)[1] for x in lines[1:]]
    assert [s.split(":")[0] for s in said] == ["throughput", "8b-pd", "done"]
    assert all(re.fullmatch(r"\S+: skipped \(budget: \d+ s left of 10\)", s) for s in said[:2]), said


def test_transfer_device_cpu_moves_the_request_between_processes_and_checks_the_bytes() -> None:
    proc = subprocess.run([sys.executable, "bench/transfer.py", "--device", "cpu", "--reps", "1"], cwd=REPO,
                          timeout=180, check=True, capture_output=True, text=True)
    res = json.loads(proc.stdout.strip().splitlines()[-1].removeprefix("RESULT "))
    assert res["bytes_checked"] is True and res["mem_type"] == "DRAM"
    assert res["kv_bytes"] == 1024 // 16 * 512 * 1024  # 64 pages of 512 KiB
    assert res["descriptors"] >= 1 and res["post_to_done_gbps_best"] > 0 and res["reps"] == 3
