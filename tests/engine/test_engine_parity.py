"""The heart of the suite: our greedy tokens == transformers' on the same checkpoint."""

from __future__ import annotations

import random

import pytest
import torch

from common.engine import Engine
from common.model import packed_linear
from tests.engine.reference import hf_greedy


def workload(vocab: int, n: int, seed: int, *, shared: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        body = [rng.randrange(3, vocab) for _ in range(rng.choice([1, 3, 9, 17, 40, 75, 130]))]
        prompts.append((shared + body) if shared and i % 2 == 0 else body)
    return prompts


def check_parity(engine: Engine, path: str, prompts: list[list[int]], max_new: int) -> list[dict]:
    params = {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True}
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out["output_ids"] == hf_greedy(path, prompt, max_new), f"prompt of {len(prompt)} tokens diverged"
        assert out["meta_info"]["completion_tokens"] == max_new
    engine.check_integrity()
    return outs


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("overlap", [True, False, "one-thread"])
def test_llama_parity_chunked_and_cached(tiny_llama_path, page_size, overlap):
    """Both loops; "one-thread" is the overlap loop as it runs on CUDA (LaunchExecutor: step N+1
    launched before step N is collected, its input ids from the FutureMap)."""
    path = str(tiny_llama_path)
    engine = Engine(
        path, dtype="float32", page_size=page_size, chunked_prefill_size=32, max_prefill_tokens=96,
        max_total_tokens=8192, disable_overlap_schedule=not overlap, enable_cpu_overlap_schedule=bool(overlap),
        overlap_worker_thread="off" if overlap == "one-thread" else "auto",
    )
    try:
        rng = random.Random(7)
        shared = [rng.randrange(3, engine.vocab_size) for _ in range(70)]
        first = workload(engine.vocab_size, 16, seed=1, shared=shared)
        check_parity(engine, path, first, 12)
        # Round two shares long prefixes with round one: the radix cache must serve them.
        second = [p + [5, 6, 7, 8] for p in first[:8]]
        outs = check_parity(engine, path, second, 8)
        cached = [o["meta_info"]["cached_tokens"] for o in outs]
        assert sum(cached) > 0 and all(c % page_size == 0 for c in cached), cached
    finally:
        engine.shutdown()


@pytest.mark.parametrize("arch_fixture", ["tiny_qwen2_path", "tiny_qwen3_path", "tiny_mistral_path"])
def test_other_layouts_parity(request, arch_fixture):
    path = str(request.getfixturevalue(arch_fixture))
    engine = Engine(path, dtype="float32", page_size=16, chunked_prefill_size=32, max_total_tokens=8192)
    try:
        rng = random.Random(3)
        shared = [rng.randrange(3, engine.vocab_size) for _ in range(40)]
        prompts = workload(engine.vocab_size, 16, seed=2, shared=shared)
        check_parity(engine, path, prompts, 10)
        outs = check_parity(engine, path, [p + [9] for p in prompts[:4]], 6)
        assert sum(o["meta_info"]["cached_tokens"] for o in outs) > 0
    finally:
        engine.shutdown()


def test_mixed_chunk_parity(tiny_llama_path):
    """--enable-mixed-chunk: decode tokens ride along prefill chunks; outputs stay exact."""
    path = str(tiny_llama_path)
    engine = Engine(path, dtype="float32", page_size=4, chunked_prefill_size=16, max_total_tokens=8192,
                    enable_mixed_chunk=True, schedule_policy="fcfs")
    try:
        check_parity(engine, path, workload(engine.vocab_size, 12, seed=8), 10)
    finally:
        engine.shutdown()


def test_retraction_parity(tiny_llama_path):
    """A pool too small for the batch forces retractions; outputs stay exact."""
    path = str(tiny_llama_path)
    engine = Engine(path, dtype="float32", page_size=4, chunked_prefill_size=32, max_total_tokens=400,
                    schedule_policy="fcfs")
    try:
        prompts = workload(engine.vocab_size, 12, seed=5)
        prompts = [p[:40] for p in prompts]
        check_parity(engine, path, prompts, 40)
        assert engine.scheduler.num_retractions > 0
    finally:
        engine.shutdown()


def test_bad_requests_leave_engine_usable(tiny_llama_path):
    path = str(tiny_llama_path)
    engine = Engine(path, dtype="float32", page_size=16, max_total_tokens=2048, context_length=256)
    try:
        with pytest.raises(ValueError, match="empty"):
            engine.generate(input_ids=[[]], sampling_params={"max_new_tokens": 2})
        with pytest.raises(ValueError, match="context length"):
            engine.generate(input_ids=[1] * 300, sampling_params={"max_new_tokens": 2})
        with pytest.raises(ValueError, match="max_new_tokens"):
            engine.generate(prompt="hello", sampling_params={"max_new_tokens": -1})
        with pytest.raises(ValueError, match="unknown sampling parameter"):
            engine.generate(prompt="hello", sampling_params={"max_new_tokens": 2, "bogus": 1})
        out = engine.generate(prompt="The quick brown fox", sampling_params={"max_new_tokens": 4, "temperature": 0})
        assert out["meta_info"]["completion_tokens"] <= 4 and isinstance(out["text"], str)
        engine.check_integrity()
    finally:
        engine.shutdown()


def test_stop_strings_and_max_new_tokens_one(tiny_llama_path):
    path = str(tiny_llama_path)
    engine = Engine(path, dtype="float32", page_size=16, max_total_tokens=2048)
    try:
        base = engine.generate(prompt="Hello world", sampling_params={"max_new_tokens": 12, "temperature": 0, "ignore_eos": True})
        text = base["text"]
        assert len(text) > 3
        stop = text[2:4]
        out = engine.generate(prompt="Hello world", sampling_params={"max_new_tokens": 12, "temperature": 0, "stop": stop, "ignore_eos": True})
        assert stop not in out["text"] and text.startswith(out["text"])
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        one = engine.generate(prompt="Hello", sampling_params={"max_new_tokens": 1, "temperature": 0, "ignore_eos": True})
        assert one["meta_info"]["completion_tokens"] == 1
        assert one["meta_info"]["finish_reason"]["type"] == "length"
        engine.check_integrity()
    finally:
        engine.shutdown()


def test_seeded_sampling_independent_of_chunking_and_batch(tiny_llama_path):
    """A seeded request samples the same tokens whether its prompt is chunked or not and
    whatever shares its batch (non-final chunks must not advance the seed or penalties)."""
    path = str(tiny_llama_path)
    prompt = list(range(5, 105))
    params = {"max_new_tokens": 12, "temperature": 0.9, "top_p": 0.95, "seed": 1234,
              "frequency_penalty": 0.5, "repetition_penalty": 1.2, "ignore_eos": True}
    outs = []
    for chunk in (-1, 32):
        engine = Engine(path, dtype="float32", page_size=16, chunked_prefill_size=chunk, max_total_tokens=4096)
        try:
            others = [[7] * 30, [9] * 50] if chunk == 32 else []
            res = engine.generate(input_ids=[prompt, *others], sampling_params=[params] + [{"max_new_tokens": 5}] * len(others))
            outs.append(res[0]["output_ids"])
            engine.check_integrity()
        finally:
            engine.shutdown()
    assert outs[0] == outs[1]


def test_torch_compile_parity(tiny_llama_path, monkeypatch):
    """--enable-torch-compile: decode batches of 1 row run a step compiled with the GEMM
    template on the plain weights (bucket 1; the template's limit lowered from 4 rows to 1 so
    that two buckets cover both kinds), 2 rows a step compiled around oneDNN's packed linears
    (bucket 2), 3-4 rows and prefill run eagerly on the packed linears; greedy tokens stay equal
    to transformers' (fp32), on the overlap loop whose worker runs what the build thread
    compiled."""
    monkeypatch.setattr(packed_linear, "COMPILED_TEMPLATE_MAX_ROWS", 1)
    path = str(tiny_llama_path)
    engine = Engine(path, dtype="float32", page_size=4, chunked_prefill_size=32, max_total_tokens=4096,
                    max_running_requests=4, enable_torch_compile=True, torch_compile_max_bs=2,
                    enable_cpu_overlap_schedule=True)
    try:
        runner = engine.core.runner
        graphs = runner.decode_graphs
        assert graphs is not None and graphs.buckets.sizes == [1, 2]
        if torch.backends.mkldnn.is_available():
            linears = [m for m in runner.model.modules() if isinstance(m, packed_linear.PackedLinear)]
            assert runner.weights_prepacked and len(linears) > 1
            assert all(m.plain_weight is not None for m in linears)
        check_parity(engine, path, workload(engine.vocab_size, 4, seed=5), 8)  # prefills end apart: 1-4 rows
        check_parity(engine, path, workload(engine.vocab_size, 1, seed=6), 6)
    finally:
        engine.shutdown()
