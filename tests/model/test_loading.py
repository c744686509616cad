"""Config parsing, weight loading, and the clear errors for inputs we cannot serve."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.model.config import ModelConfig, ModelConfigError, cpu_has_native_bf16, resolve_dtype
from common.model.forward_batch import ForwardMode
from common.model.loader import WeightLoadError
from common.model.model_runner import ModelRunner
from common.model.testing import build_tiny_checkpoint
from tests.model.harness import PagedHarness, hf_logits, load_hf


def copy_ckpt(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(path: Path, **changes: object) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def runner_for(path: str | Path, **kw: object) -> ModelRunner:
    config = ModelConfig.from_pretrained(str(path))
    pool = ModelRunner.create_kv_pool(config, max_total_tokens=64, page_size=4, dtype="float32")
    return ModelRunner(
        str(path), dtype="float32", kv_pool=pool, req_to_token=torch.zeros(2, 64, dtype=torch.int64), **kw
    )  # type: ignore[arg-type]


def test_config_layouts(tiny_checkpoint) -> None:
    llama = ModelConfig.from_pretrained(tiny_checkpoint("llama"))
    qwen2 = ModelConfig.from_pretrained(tiny_checkpoint("qwen2"))
    qwen3 = ModelConfig.from_pretrained(tiny_checkpoint("qwen3"))
    assert (llama.architecture, llama.qkv_bias, llama.qk_norm) == ("llama", False, False)
    assert (qwen2.architecture, qwen2.qkv_bias, qwen2.o_bias) == ("qwen2", True, False)
    assert (qwen3.architecture, qwen3.qk_norm) == ("qwen3", True)
    assert (llama.num_layers, llama.num_heads, llama.num_kv_heads, llama.head_dim) == (2, 4, 2, 16)
    assert llama.context_length == 1024 and llama.rope_type == "default" and llama.rope_theta == 10000.0
    assert llama.eos_token_ids == (2,)


def test_eos_ids_merge_config_and_generation_config(tmp_path: Path, tiny_llama_path: str) -> None:
    path = copy_ckpt(tiny_llama_path, tmp_path / "c")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert ModelConfig.from_pretrained(str(path)).eos_token_ids == (2, 7)


def test_sliding_window_caps_context(tmp_path: Path, tiny_mistral_path: str) -> None:
    path = copy_ckpt(tiny_mistral_path, tmp_path / "c")
    edit_config(path, sliding_window=128)
    assert ModelConfig.from_pretrained(str(path)).context_length == 128


def test_unsupported_inputs_raise_clear_errors(tmp_path: Path, tiny_llama_path: str) -> None:
    with pytest.raises(ModelConfigError, match="no config.json"):
        ModelConfig.from_pretrained(str(tmp_path))
    gpt2 = copy_ckpt(tiny_llama_path, tmp_path / "gpt2")
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelConfigError, match="unsupported architecture 'gpt2'"):
        ModelConfig.from_pretrained(str(gpt2))
    dyn = copy_ckpt(tiny_llama_path, tmp_path / "dyn")
    edit_config(dyn, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(ModelConfigError, match="unsupported rope_scaling type 'dynamic'"):
        ModelConfig.from_pretrained(str(dyn))
    gelu = copy_ckpt(tiny_llama_path, tmp_path / "gelu")
    edit_config(gelu, hidden_act="gelu")
    with pytest.raises(ModelConfigError, match="activation"):
        ModelConfig.from_pretrained(str(gelu))


def test_resolve_dtype() -> None:
    assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("float16", "cpu") == torch.float16
    assert resolve_dtype(torch.float32, "cpu") == torch.float32
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        resolve_dtype("fp8", "cpu")


def _rewrite(path: Path, change) -> None:
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors")


def test_weight_errors_name_the_tensors(tmp_path: Path, tiny_qwen2_path: str) -> None:
    missing = copy_ckpt(tiny_qwen2_path, tmp_path / "missing")
    _rewrite(missing, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(WeightLoadError, match=r"missing tensor.*layers\.1\.self_attn\.qkv_proj\.bias\[64:96\]"):
        runner_for(missing)
    extra = copy_ckpt(tiny_qwen2_path, tmp_path / "extra")
    _rewrite(extra, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
    with pytest.raises(WeightLoadError, match=r"unexpected tensor.*model\.layers\.0\.mlp\.extra\.weight"):
        runner_for(extra)
    shape = copy_ckpt(tiny_qwen2_path, tmp_path / "shape")
    _rewrite(shape, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 64)}))
    with pytest.raises(WeightLoadError, match=r"up_proj\.weight has shape \(3, 64\), expected \(128, 64\)"):
        runner_for(shape)
    empty = copy_ckpt(tiny_qwen2_path, tmp_path / "empty")
    (empty / "model.safetensors").unlink()
    with pytest.raises(WeightLoadError, match="no \\*.safetensors"):
        runner_for(empty)


def test_sharded_checkpoint_loads_like_single_file(tmp_path: Path, tiny_llama_path: str) -> None:
    sharded = copy_ckpt(tiny_llama_path, tmp_path / "sharded")
    tensors = load_file(sharded / "model.safetensors")
    (sharded / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, sharded / fname)
        weight_map.update({n: fname for n in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    # compare the loaded weights themselves (packed oneDNN weights are opaque tensors)
    a, b = runner_for(tiny_llama_path, cpu_weight_prepack=False), runner_for(sharded, cpu_weight_prepack=False)
    for (name, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert torch.equal(p, q), name


def test_tied_embeddings_match_transformers(tmp_path: Path) -> None:
    path = build_tiny_checkpoint(tmp_path / "tied", "llama", tie_word_embeddings=True)
    h = PagedHarness(str(path), page_size=2)
    assert h.runner.model.lm_head is None
    ids = [5, 9, 30, 31, 7, 100]
    ours = h.step(ForwardMode.EXTEND, [("a", ids)])
    assert (ours - hf_logits(load_hf(str(path)), ids)).abs().max().item() < 1e-4


def test_runner_rejects_bad_setup(tiny_llama_path: str) -> None:
    config = ModelConfig.from_pretrained(tiny_llama_path)
    r2t = torch.zeros(2, 64, dtype=torch.int64)
    wrong = ModelRunner.create_kv_pool(config, max_total_tokens=64, page_size=4, dtype="float32")
    wrong.num_kv_heads = 3  # a pool sized for another model
    with pytest.raises(ValueError, match="does not fit the model"):
        ModelRunner(tiny_llama_path, dtype="float32", kv_pool=wrong, req_to_token=r2t)
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        runner_for(tiny_llama_path, attention_backend="nope")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="flashinfer attention backend needs a CUDA"):
            runner_for(tiny_llama_path, attention_backend="flashinfer")


def test_kv_pool_sizing(tiny_llama_path: str) -> None:
    config = ModelConfig.from_pretrained(tiny_llama_path)
    pool = ModelRunner.create_kv_pool(config, max_total_tokens=100, page_size=16, dtype="bfloat16")
    assert pool.num_pages == 1 + 7 and pool.dtype == torch.bfloat16  # reserved page + ceil(100 / 16)
    assert ModelRunner.kv_bytes_per_token(config, "bfloat16") * pool.num_slots == pool.total_bytes()
