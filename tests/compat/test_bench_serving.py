"""SGLang's own benchmark client, unchanged, against the router over 1P1D, in its three backends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.compat.cluster import Cluster
from tests.compat.sglang_bench import bench_serving_root

NUM_PROMPTS = 8
INPUT_LEN = 24
OUTPUT_LEN = 10


@pytest.fixture(scope="module")
def bench_root() -> Path:
    try:
        return bench_serving_root()
    except (subprocess.SubprocessError, OSError) as e:
        pytest.skip(f"cannot fetch SGLang's wheel for its bench_serving client: {e}")


@pytest.mark.parametrize("backend", ["sglang", "sglang-oai", "sglang-oai-chat"])
def test_bench_serving_backend(cluster: Cluster, bench_root: Path, backend: str, tmp_path: Path) -> None:
    out = tmp_path / "result.jsonl"
    argv = [sys.executable, "-m", "sglang.bench_serving", "--backend", backend, "--base-url", cluster.router.url,
            "--model", str(cluster.model), "--tokenizer", str(cluster.model), "--dataset-name", "random-ids",
            "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN), "--random-range-ratio", "1",
            "--num-prompts", str(NUM_PROMPTS), "--request-rate", "inf", "--temperature", "0",
            "--output-file", str(out), "--disable-tqdm"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(bench_root), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text().splitlines()[-1])
    assert result["completed"] == NUM_PROMPTS, proc.stdout[-3000:]
    # ignore_eos is on by default in bench_serving: every request produced exactly OUTPUT_LEN tokens
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN, result
    assert result["total_input_tokens"] >= NUM_PROMPTS * INPUT_LEN * 0.9, result
