"""SGLang's own benchmark client, unchanged, against the router over 1P1D, in its three backends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.compat.cluster import Cluster
from tests.compat.sglang_bench import DRIVER, bench_serving_root

NUM_PROMPTS = 8
INPUT_LEN = 24
OUTPUT_LEN = 10


@pytest.fixture(scope="module")
def bench_root() -> Path:
    try:
        return bench_serving_root()
    except (subprocess.SubprocessError, OSError) as e:
        pytest.skip(f"cannot fetch SGLang's wheel for its bench_serving client: {e}")


BACKENDS = ("sglang", "sglang-oai", "sglang-oai-chat")
# One client process (sglang_bench.DRIVER) runs the three backends one after another; a
# backend's failure is written to its own status file, so the others are still judged.


@dataclass(frozen=True)
class BenchRun:
    proc: subprocess.CompletedProcess[str]
    dir: Path


@pytest.fixture(scope="module")
def bench_run(cluster: Cluster, bench_root: Path, tmp_path_factory: pytest.TempPathFactory) -> BenchRun:
    out = tmp_path_factory.mktemp("bench_serving")
    argvs = {b: ["--backend", b, "--base-url", cluster.router.url,
                 "--model", str(cluster.model), "--tokenizer", str(cluster.model), "--dataset-name", "random-ids",
                 "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
                 "--random-range-ratio", "1", "--num-prompts", str(NUM_PROMPTS), "--request-rate", "inf",
                 "--temperature", "0", "--output-file", str(out / f"{b}.jsonl"), "--disable-tqdm"]
             for b in BACKENDS}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(bench_root), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(argvs)], env=env, capture_output=True,
                          text=True, timeout=600, cwd=out)
    return BenchRun(proc, out)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bench_serving_backend(bench_run: BenchRun, backend: str) -> None:
    proc, out = bench_run.proc, bench_run.dir
    status = out / f"{backend}.status"
    assert status.exists() and status.read_text() == "ok", (
        (status.read_text() if status.exists() else "") + proc.stdout[-3000:] + proc.stderr[-3000:])
    result = json.loads((out / f"{backend}.jsonl").read_text().splitlines()[-1])
    assert result["completed"] == NUM_PROMPTS, proc.stdout[-3000:]
    # ignore_eos is on by default in bench_serving: every request produced exactly OUTPUT_LEN tokens
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN, result
    assert result["total_input_tokens"] >= NUM_PROMPTS * INPUT_LEN * 0.9, result
