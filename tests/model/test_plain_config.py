"""config.json read as it is (common/model/plain_config.py) gives the ModelConfig AutoConfig gives."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from transformers import AutoConfig

from common.model.config import ModelConfig
from common.model.plain_config import read_plain_config

ROOT = Path(__file__).resolve().parents[2]


def via_auto_config(path: str) -> ModelConfig:
    return ModelConfig.from_hf_config(AutoConfig.from_pretrained(path), path)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_every_tiny_layout_reads_plain_and_equal(arch: str, tiny_checkpoint: Callable[..., str]) -> None:
    path = tiny_checkpoint(arch)
    assert read_plain_config(path) is not None
    assert ModelConfig.from_pretrained(path) == via_auto_config(path)


def test_tied_embeddings_and_legacy_rope_theta_read_plain_and_equal(tiny_checkpoint: Callable[..., str],
                                                                     tmp_path: Path) -> None:
    src = tiny_checkpoint("llama", tie_word_embeddings=True)
    path = tmp_path / "legacy"
    shutil.copytree(src, path)
    raw = json.loads((path / "config.json").read_text())
    raw["rope_theta"] = raw.pop("rope_parameters")["rope_theta"] * 2
    raw["rope_scaling"] = None
    (path / "config.json").write_text(json.dumps(raw))
    assert read_plain_config(path) is not None
    plain = ModelConfig.from_pretrained(path)
    assert plain == via_auto_config(str(path))
    assert plain.tie_word_embeddings and plain.rope_theta == 20000.0


@pytest.mark.parametrize("edit", ["drop_eos", "drop_head_dim_qwen3", "llama3_rope", "drop_sliding_window"])
def test_a_config_leaning_on_class_defaults_goes_through_auto_config(edit: str, tiny_checkpoint: Callable[..., str],
                                                                     tmp_path: Path) -> None:
    arch = {"drop_head_dim_qwen3": "qwen3", "drop_sliding_window": "mistral"}.get(edit, "llama")
    path = tmp_path / edit
    shutil.copytree(tiny_checkpoint(arch), path)
    raw = json.loads((path / "config.json").read_text())
    if edit == "drop_eos":
        del raw["eos_token_id"]
    elif edit == "drop_head_dim_qwen3":
        del raw["head_dim"]
    elif edit == "drop_sliding_window":
        del raw["sliding_window"]
    else:
        raw["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 256}
    (path / "config.json").write_text(json.dumps(raw))
    assert read_plain_config(path) is None
    assert ModelConfig.from_pretrained(path) == via_auto_config(str(path))


def test_reading_a_plain_config_imports_no_transformers(tiny_llama_path: str) -> None:
    code = ("import sys; from common.model.config import ModelConfig; "
            f"ModelConfig.from_pretrained({tiny_llama_path!r}); print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False"]


@pytest.mark.slow
def test_the_default_model_reads_plain_and_equal(default_model_path: str) -> None:
    assert read_plain_config(default_model_path) is not None
    assert ModelConfig.from_pretrained(default_model_path) == via_auto_config(default_model_path)
