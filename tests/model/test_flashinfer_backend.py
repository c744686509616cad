"""The flashinfer backend against float64 attention and the torch backend.

On CPU it runs on tests/model/flashinfer_reference.py (installed as the `flashinfer` module),
which checks what the real kernels would refuse; on a GPU the same cases run on the real
flashinfer. Shapes: head_dim 64/128, GQA ratios 1/3/4/5/7/8 (5 and 7 are Qwen2.5/Qwen3's,
which flashinfer's CUDA-core decode kernel does not have), pages 1/16, bf16/fp16, and every
batch of the attention cases (prefix + chunk, decode, mixed) and of the model parity schedule.
"""

from __future__ import annotations

import random

import pytest
import torch

from common.model.attention import AttentionShape, create_attention_backend
from common.model.testing import build_tiny_checkpoint
from tests.model import flashinfer_reference
from tests.model.attention_cases import CASES, gqa_shape, make_case, reference
from tests.model.harness import PagedHarness
from tests.model.test_model_parity import parity_steps

GROUPS = [1, 3, 4, 5, 7, 8]
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3}  # atol = rtol, vs float64


@pytest.fixture
def cpu_flashinfer(monkeypatch: pytest.MonkeyPatch) -> None:
    flashinfer_reference.install(monkeypatch)


def check_against_references(case: str, page_size: int, shape: AttentionShape, dtype: torch.dtype, device: str) -> None:
    mode, lens = CASES[case]
    pool, r2t, batch, q = make_case(shape, mode, lens, page_size, device, dtype)
    flashinfer = create_attention_backend("flashinfer", shape=shape, kv_pool=pool, req_to_token=r2t)
    torch_backend = create_attention_backend("torch", shape=shape, kv_pool=pool, req_to_token=r2t)
    flashinfer.init_forward_metadata(batch)
    torch_backend.init_forward_metadata(batch)
    tol = TOLERANCE[dtype]
    for layer in range(pool.num_layers):
        got = flashinfer.forward(q, q, q, layer, batch)  # k/v args unused: the pool already holds them
        assert got.dtype == dtype and got.shape == (batch.num_tokens, shape.num_heads * shape.head_dim)
        want = reference(shape, pool, r2t, batch, q, layer)
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
        torch.testing.assert_close(got.float(), torch_backend.forward(q, q, q, layer, batch).float(), rtol=tol, atol=tol)


@pytest.mark.parametrize(("head_dim", "dtype"), [(64, torch.bfloat16), (128, torch.float16)])
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", list(CASES))
def test_flashinfer_on_the_cpu_reference_matches(
    cpu_flashinfer: None, case: str, page_size: int, group: int, head_dim: int, dtype: torch.dtype
) -> None:
    check_against_references(case, page_size, gqa_shape(head_dim, group), dtype, "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", list(CASES))
def test_flashinfer_on_cuda_matches(case: str, page_size: int, group: int, head_dim: int, dtype: torch.dtype) -> None:
    pytest.importorskip("flashinfer")
    check_against_references(case, page_size, gqa_shape(head_dim, group), dtype, "cuda")


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (4, 1)])
def test_flashinfer_model_matches_torch_on_the_parity_schedule(
    cpu_flashinfer: None, tmp_path_factory: pytest.TempPathFactory, page_size: int, num_heads: int, num_kv_heads: int
) -> None:
    """Every batch of the model parity schedule (extend, extend on a prefix, decode, mixed),
    through the whole model in bf16: the flashinfer backend's logits == the torch backend's."""
    path = build_tiny_checkpoint(
        tmp_path_factory.mktemp("hd64"), "qwen2", hidden_size=64 * num_heads, num_heads=num_heads,
        num_kv_heads=num_kv_heads,
    )
    harness = {
        name: PagedHarness(str(path), page_size=page_size, dtype="bfloat16", attention_backend=name, seed=page_size)
        for name in ("torch", "flashinfer")
    }
    vocab = harness["torch"].runner.vocab_size
    for mode, steps in parity_steps(random.Random(page_size), vocab):
        logits = {name: h.step(mode, steps) for name, h in harness.items()}
        scale = logits["torch"].abs().max().item()
        diff = (logits["flashinfer"] - logits["torch"]).abs().max().item()
        assert diff <= 0.02 * scale, f"{mode}: max |diff| {diff} (logits up to {scale})"
    assert harness["flashinfer"].runner.attn_backend.__class__.__name__ == "FlashInferAttentionBackend"
