"""lm-eval's `local-completions` (unchanged) runs a multiple-choice loglikelihood task against the
router over 1P1D; its per-choice loglikelihoods equal transformers' on the same checkpoint."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from tests.compat.cluster import Cluster

DOCS = [
    {"question": "The sky is", "choices": ["blue", "green", "loud"], "answer": 0},
    {"question": "Two plus two is", "choices": ["four", "five"], "answer": 0},
    {"question": "Cats like to", "choices": ["sleep", "fly", "swim", "sing"], "answer": 0},
]
TASK = """task: pdserve_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


@functools.cache
def reference_model(model: str) -> tuple[PreTrainedTokenizerBase, PreTrainedModel]:
    """transformers' tokenizer and model, loaded once for all the choices."""
    return AutoTokenizer.from_pretrained(model), AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)


def reference_loglikelihood(model: str, context: str, continuation: str) -> float:
    """As lm-eval asks: context and continuation tokenized separately, then concatenated."""
    tok, hf = reference_model(model)
    ctx = tok.encode(context)
    full = ctx + tok.encode(continuation)
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([full])).logits[0].float(), dim=-1)
    return sum(logprobs[i - 1, full[i]].item() for i in range(len(ctx), len(full)))


def test_lm_eval_local_completions(cluster: Cluster, tmp_path: Path) -> None:
    pytest.importorskip("lm_eval")
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "pdserve_tiny_mc.yaml").write_text(TASK.format(data=data))
    model = str(cluster.model)
    args = (f"model={model},base_url={cluster.router.url}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={model},num_concurrent=2,max_retries=1")
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
            "--tasks", "pdserve_tiny_mc", "--include_path", str(tasks), "--output_path", str(out), "--log_samples"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=400, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    samples_files = list(out.rglob("samples_pdserve_tiny_mc_*.jsonl"))
    assert samples_files, list(out.rglob("*"))
    samples = [json.loads(line) for line in samples_files[0].read_text().splitlines()]
    assert len(samples) == len(DOCS)
    for s in samples:
        doc = s["doc"]
        got = [float(r[0][0]) for r in s["resps"]]  # (loglikelihood, is_greedy) per choice
        # lm-eval joins context and choice with the task's target_delimiter, " "
        want = [reference_loglikelihood(model, doc["question"], " " + c) for c in doc["choices"]]
        assert got == pytest.approx(want, abs=1e-3), (doc, got, want)
