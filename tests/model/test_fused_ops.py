"""flashinfer's fused RMSNorm (+ residual) and SiLU-and-mul against the torch ops (fused_ops.py).

On CPU the kernels are tests/model/flashinfer_reference.py's stand-ins, with the real
signatures and restrictions (fp16/bf16, 2-D contiguous inputs, in-place fused_add_rmsnorm);
on a GPU the same comparisons run on the real kernels.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from common.model.forward_batch import ForwardMode
from common.model.fused_ops import FlashInferOps, TorchOps, select_fused_ops
from common.model.testing import build_tiny_checkpoint
from tests.model import flashinfer_reference
from tests.model.harness import PagedHarness

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def fused_ops(device: str, monkeypatch: pytest.MonkeyPatch) -> TorchOps:
    if device == "cpu":
        flashinfer_reference.install(monkeypatch)
    else:
        pytest.importorskip("flashinfer")
    ops = select_fused_ops(torch.device(device), torch.bfloat16)
    assert isinstance(ops, FlashInferOps)
    return ops


@pytest.mark.parametrize("device", DEVICES)
def test_each_fused_op_matches_torch(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ops, ref = fused_ops(device, monkeypatch), TorchOps()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 128, generator=g).to(device, torch.bfloat16)
    res = torch.randn(7, 128, generator=g).to(device, torch.bfloat16)
    w = (1 + 0.1 * torch.randn(128, generator=g)).to(device, torch.bfloat16)
    tol = {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5), **tol)
    want_h, want_res = ref.add_rms_norm(x, res, w, 1e-5)
    got_h, got_res = ops.add_rms_norm(x.clone(), res.clone(), w, 1e-5)
    torch.testing.assert_close(got_res, want_res, **tol)
    torch.testing.assert_close(got_h, want_h, **tol)
    gate_up = torch.randn(7, 256, generator=g).to(device, torch.bfloat16)
    torch.testing.assert_close(ops.silu_and_mul(gate_up), ref.silu_and_mul(gate_up), **tol)


def test_fp32_and_cpu_without_flashinfer_keep_the_torch_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    flashinfer_reference.install(monkeypatch)
    assert type(select_fused_ops(torch.device("cpu"), torch.float32)) is TorchOps
    monkeypatch.setattr(flashinfer_reference, "PDSERVE_DEVICE_TYPES", ("cuda",))
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "0")  # CPU bf16 otherwise runs pdserve's C kernels (test_cpu_kernels.py)
    assert type(select_fused_ops(torch.device("cpu"), torch.bfloat16)) is TorchOps


def test_model_with_fused_ops_matches_torch_ops(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path_factory: pytest.TempPathFactory) -> None:
    """The whole decoder in bf16 (prefill, then decode): every norm but the first and the
    per-head ones is a fused_add_rmsnorm, every MLP a silu_and_mul; logits agree with torch's."""
    flashinfer_reference.install(monkeypatch)
    path = str(build_tiny_checkpoint(tmp_path_factory.mktemp("fused"), "qwen3", hidden_size=128, num_heads=2,
                                     num_kv_heads=1, num_layers=3))
    fused = PagedHarness(path, page_size=4, dtype="bfloat16", seed=1)
    plain = PagedHarness(path, page_size=4, dtype="bfloat16", seed=1)
    assert isinstance(fused.runner.model.ops, FlashInferOps)
    plain.runner.model.ops = TorchOps()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (5, 13)]
    steps = [(ForwardMode.EXTEND, [(f"r{i}", p) for i, p in enumerate(prompts)])]
    steps += [(ForwardMode.DECODE, [(f"r{i}", [rng.randrange(3, 200)]) for i in range(2)]) for _ in range(3)]
    flashinfer_reference.CALLS.clear()
    for mode, batch in steps:
        want, got = plain.step_last(mode, batch), fused.step_last(mode, batch)
        assert (got - want).abs().max().item() <= 0.03 * want.abs().max().item()
    names = [name for name, _, _ in flashinfer_reference.CALLS]
    # per step: layer 0's input norm (no residual yet), 2 fused_add_rmsnorm per layer after it
    # (the last is the final norm), 1 silu_and_mul per layer; qwen3's per-head norms stay torch
    per_step = (1, 2 * 3, 3)
    counts = (names.count("rmsnorm"), names.count("fused_add_rmsnorm"), names.count("silu_and_mul"))
    assert counts == tuple(n * len(steps) for n in per_step)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_rotation_is_the_rotate_half_formula_bit_for_bit(dtype: torch.dtype) -> None:
    """RopeTable rotates with 4 ops (x * [cos|cos] + roll(x) * [-sin|sin]); the numbers are
    exactly HF's [x1*cos - x2*sin | x2*cos + x1*sin]."""
    from common.model.rope import RopeTable

    gen = torch.Generator().manual_seed(0)
    cos, sin = torch.randn(9, 1, 32, generator=gen), torch.randn(9, 1, 32, generator=gen)
    x = torch.randn(9, 3, 64, generator=gen).to(dtype)
    x1, x2 = x.float().chunk(2, dim=-1)
    expected = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(dtype)
    table = RopeTable(torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1), torch.arange(9), torch.empty(0))
    assert torch.equal(table.apply(x, x)[0], expected)


def test_fused_rope_rotates_strided_q_and_k_in_place(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """FlashInferOps.rope hands q and k (strided views of the qkv output) to the one kernel, with
    [cos | sin] of every position; check() keeps it when it agrees with RopeTable.apply, and
    falls back to torch's rope when the kernel rotates another layout."""
    from common.model.config import ModelConfig
    from common.model.rope import RotaryEmbedding

    ops = fused_ops("cpu", monkeypatch)
    assert isinstance(ops, FlashInferOps)
    build_tiny_checkpoint(tmp_path, "llama")
    config = ModelConfig.from_pretrained(str(tmp_path))
    rope, d = RotaryEmbedding(config, "cpu"), config.head_dim
    ops.check(rope, 4, 2, torch.device("cpu"), torch.bfloat16)
    assert ops.fused_rope
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, 8 * d, generator=g).to(torch.bfloat16)
    q, k, _ = qkv.split([4 * d, 2 * d, 2 * d], dim=-1)
    q, k = q.reshape(5, 4, d), k.reshape(5, 2, d)
    table = rope.table(torch.tensor([0, 3, 4, 9, 30]))
    want_q, want_k = TorchOps().rope(q, k, table)
    got_q, got_k = ops.rope(q, k, table)
    assert got_q.data_ptr() == qkv.data_ptr()  # in place, in the qkv output
    torch.testing.assert_close(got_q, want_q, rtol=2e-2, atol=6e-2)
    torch.testing.assert_close(got_k, want_k, rtol=2e-2, atol=6e-2)

    interleaved = flashinfer_reference.apply_rope_with_cos_sin_cache_inplace
    monkeypatch.setattr(flashinfer_reference, "apply_rope_with_cos_sin_cache_inplace",
                        lambda *a, **kw: interleaved(*a, **{**kw, "is_neox": False}))
    ops.check(rope, 4, 2, torch.device("cpu"), torch.bfloat16)
    assert not ops.fused_rope
