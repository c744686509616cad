"""Decode steps padded to batch-size buckets (decode_buckets.py / decode_graphs.py).

On CPU the steps run through EagerCapture: the buckets, the static input buffers, the
padding rows and flashinfer's per-bucket CUDA-graph wrappers (on the CPU stand-in) are the
same code a CUDA graph replays, so a padded step must give the unpadded step's logits and
the engine's greedy tokens must stay transformers'. The CUDA test captures real graphs.
"""

from __future__ import annotations

import random

import pytest
import torch

from common.engine import Engine
from common.model.decode_buckets import DecodeBuckets, capture_batch_sizes
from common.model.decode_graphs import EagerCapture, StepCapture
from common.model.forward_batch import ForwardMode
from common.model.testing import build_tiny_checkpoint
from tests.engine.reference import hf_greedy
from tests.model import flashinfer_reference
from tests.model.harness import PagedHarness

LENGTHS = [3, 17, 30, 9, 64, 1]


def test_buckets_are_sglangs_capture_sizes() -> None:
    assert capture_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    buckets = DecodeBuckets(20)
    assert [buckets.bucket_for(n) for n in (1, 3, 5, 9, 16, 17, 20, 21, 0)] == [1, 4, 8, 16, 16, 20, 20, None, None]


def run_schedule(h: PagedHarness, seed: int) -> list[torch.Tensor]:
    """Prompts in one EXTEND, then DECODE steps of shrinking / regrowing subsets of them."""
    rng = random.Random(seed)
    vocab = h.runner.vocab_size
    names = [f"r{i}" for i in range(len(LENGTHS))]
    h.step_last(ForwardMode.EXTEND, [(n, [rng.randrange(3, vocab) for _ in range(k)]) for n, k in zip(names, LENGTHS, strict=True)])
    out = []
    for subset in (names, names[:5], names[1:4], names[2:3], names, names[::2]):
        # A replayed graph returns a view of its static output, rewritten by the bucket's next
        # replay (steps 1, 2 and 5 share bucket 8): keep a copy of each step's logits.
        out.append(h.step_last(ForwardMode.DECODE, [(n, [rng.randrange(3, vocab)]) for n in subset]).clone())
    return out


def compare(dtype: str, backend: str, graph_backend: str, path: str, capture: StepCapture, tol: float) -> None:
    plain = PagedHarness(path, page_size=4, dtype=dtype, attention_backend=backend, seed=1)
    graphs = PagedHarness(path, page_size=4, dtype=dtype, attention_backend=graph_backend, seed=1)
    graphs.runner.enable_decode_graphs(8, capture)
    for want, got in zip(run_schedule(plain, 0), run_schedule(graphs, 0), strict=True):
        assert got.shape == want.shape
        scale = want.abs().max().item()
        assert (got - want).abs().max().item() <= tol * scale
        if dtype == "float32":  # bf16 noise of a random model flips near-ties
            assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_padded_decode_steps_match_unpadded_torch_backend(tiny_llama_path: str) -> None:
    compare("float32", "torch", "torch", tiny_llama_path, EagerCapture(), 1e-5)


@pytest.fixture(scope="module")
def head_dim_64_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_checkpoint(tmp_path_factory.mktemp("hd64-graphs"), "qwen2", hidden_size=128, num_heads=2,
                                     num_kv_heads=1))


def test_flashinfer_graph_wrappers_match_the_torch_backend(monkeypatch: pytest.MonkeyPatch, head_dim_64_model: str) -> None:
    """The flashinfer backend in CUDA-graph mode (one wrapper per bucket, fixed buffers,
    replanned before each step) on the CPU stand-in, against the torch backend unpadded."""
    flashinfer_reference.install(monkeypatch)
    compare("bfloat16", "torch", "flashinfer", head_dim_64_model, EagerCapture(), 0.02)
    graph_wrappers = [kw for name, _, kw in flashinfer_reference.CALLS
                      if name.endswith("DecodeWithPagedKVCacheWrapper.__init__") and kw.get("use_cuda_graph")]
    assert len(graph_wrappers) == len(capture_batch_sizes(8))
    planned = [len(args[2]) for name, args, _ in flashinfer_reference.CALLS
               if name.endswith("BatchDecodeWithPagedKVCacheWrapper.plan")]
    assert set(planned) >= {8, 4, 1}, planned  # 6 rows -> 8, 5 -> 8, 3 -> 4, 1 -> 1


@pytest.mark.parametrize("overlap", [False, True, "one-thread"])
def test_engine_greedy_parity_with_bucketed_decode(tiny_llama_path: str, overlap: bool | str) -> None:
    """"one-thread": step N+1 replays the bucket's step (overwriting its static logits) before
    step N's tokens are collected, as on CUDA."""
    engine = Engine(tiny_llama_path, dtype="float32", page_size=4, chunked_prefill_size=32, max_total_tokens=4096,
                    max_running_requests=8, disable_overlap_schedule=not overlap,
                    enable_cpu_overlap_schedule=bool(overlap), overlap_worker_thread="off" if overlap == "one-thread" else "auto")
    try:
        engine.core.runner.enable_decode_graphs(8, EagerCapture())
        rng = random.Random(3)
        prompts = [[rng.randrange(3, engine.vocab_size) for _ in range(n)] for n in (5, 40, 12, 3, 21)]
        outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 10, "temperature": 0.0,
                                                                   "ignore_eos": True})
        for prompt, out in zip(prompts, outs, strict=True):
            assert out["output_ids"] == hf_greedy(tiny_llama_path, prompt, 10)
        engine.check_integrity()
    finally:
        engine.shutdown()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_match_eager_decode(head_dim_64_model: str) -> None:
    pytest.importorskip("flashinfer")
    from common.model.cuda_graphs import CudaGraphCapture

    device = torch.device("cuda", torch.cuda.current_device())
    plain = PagedHarness(head_dim_64_model, page_size=4, dtype="bfloat16", attention_backend="flashinfer", seed=1,
                         device=device)
    graphs = PagedHarness(head_dim_64_model, page_size=4, dtype="bfloat16", attention_backend="flashinfer", seed=1,
                          device=device)
    graphs.runner.enable_decode_graphs(8, CudaGraphCapture(device))
    for want, got in zip(run_schedule(plain, 0), run_schedule(graphs, 0), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
