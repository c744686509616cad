"""pdserve's fused CPU kernels (common/model/cpu_kernels, cpu_fused_ops.py) against the torch path.

Each fused op against TorchOps on the same bf16 inputs (within bf16 rounding: the kernels do
fp32 math and round where torch does); the fused paged decode attention against the float64
reference of tests/model/attention_cases.py; the whole decoder with CpuFusedOps against the
same model on TorchOps; and the fallbacks (no compiler, PDSERVE_CPU_KERNELS=0, fp32).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from common.cache.kv_pool import KVPool
from common.model import cpu_kernels as cpu_kernels_module
from common.model.attention import AttentionShape, create_attention_backend
from common.model.config import ModelConfig
from common.model.cpu_fused_ops import CpuFusedOps
from common.model.cpu_kernels import build_cpu_kernels, cpu_kernels
from common.model.forward_batch import ForwardMode
from common.model.fused_ops import TorchOps, select_fused_ops
from common.model.rope import RotaryEmbedding
from common.model.testing import build_tiny_checkpoint
from tests.model.attention_cases import CASES, make_case, reference
from tests.model.harness import PagedHarness

BF16 = torch.bfloat16
TOL = {"rtol": 2e-2, "atol": 2e-2}


@pytest.fixture(scope="module")
def ops() -> CpuFusedOps:
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no C compiler here: the kernels cannot build (the fallback is tested below)")
    return CpuFusedOps(kernels)


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(BF16)


def test_norms_and_silu_match_torch(ops: CpuFusedOps) -> None:
    ref = TorchOps()
    x, res, w = _rand(7, 576, seed=1), _rand(7, 576, seed=2), 1 + 0.1 * _rand(576, seed=3)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5), **TOL)
    heads, hw = _rand(5, 3, 64, seed=4), 1 + 0.1 * _rand(64, seed=5)  # qk_norm: per-head rows
    torch.testing.assert_close(ops.rms_norm(heads, hw, 1e-6), ref.rms_norm(heads, hw, 1e-6), **TOL)
    want_h, want_res = ref.add_rms_norm(x, res, w, 1e-5)
    xc, rc = x.clone(), res.clone()
    got_h, got_res = ops.add_rms_norm(xc, rc, w, 1e-5)
    assert got_h.data_ptr() == xc.data_ptr() and got_res.data_ptr() == rc.data_ptr()  # in place
    torch.testing.assert_close(got_res, want_res, rtol=0, atol=0)  # one bf16 add: exact
    torch.testing.assert_close(got_h, want_h, **TOL)
    gate_up = _rand(7, 2 * 1536, seed=6)
    torch.testing.assert_close(ops.silu_and_mul(gate_up), ref.silu_and_mul(gate_up), **TOL)
    assert ops.silu_and_mul(gate_up[:, :64].clone()).shape == (7, 32)


def test_rope_kv_rotates_in_place_and_writes_the_pool_like_set_kv(ops: CpuFusedOps, tmp_path: Path) -> None:
    """q and k as the model has them (strided views into one qkv row), positions anywhere in
    the context; the pool rows match KVPool.set_kv of torch's rotated k and v."""
    config = ModelConfig.from_pretrained(str(build_tiny_checkpoint(tmp_path, "llama")))
    rope = RotaryEmbedding(config, "cpu")
    hq, hk, d, n = 6, 2, config.head_dim, 5
    qkv = _rand(n, (hq + 2 * hk) * d, seed=7)
    table = rope.table(torch.tensor([0, 1, 9, 33, config.context_length - 1]))

    def views(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = t.split([hq * d, hk * d, hk * d], dim=-1)
        return q.reshape(n, hq, d), k.reshape(n, hk, d), v.reshape(n, hk, d)

    pools = [KVPool(num_layers=3, num_pages=8, page_size=4, num_kv_heads=hk, head_dim=d, dtype=BF16, device="cpu")
             for _ in range(2)]
    slots = torch.tensor([4, 5, 13, 30, 7])
    want_q, want_k = table.apply(*views(qkv)[:2])
    pools[0].set_kv(1, slots, want_k, views(qkv)[2])
    got = qkv.clone()
    q, k, written = ops.rope_kv(*views(got), table, pools[1], 1, slots)
    assert written and q.data_ptr() == got.data_ptr()
    torch.testing.assert_close(q, want_q, **TOL)
    torch.testing.assert_close(k, want_k, **TOL)
    torch.testing.assert_close(pools[1].kv, pools[0].kv, **TOL)
    assert pools[1].kv[:, [0, 2]].abs().sum() == 0  # other layers untouched
    q2, k2 = ops.rope(*views(qkv.clone())[:2], table)  # rope alone writes nothing
    torch.testing.assert_close(q2, want_q, **TOL)
    q3, k3, written = ops.rope_kv(*views(qkv.float()), table, pools[1], 1, slots)  # fp32: torch's rope, no write
    assert not written
    torch.testing.assert_close(q3, table.apply(*views(qkv.float())[:2])[0], rtol=0, atol=0)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("head_dim", "group"), [(8, 3), (64, 3), (64, 1), (128, 8)])
def test_fused_decode_attention_matches_reference(ops: CpuFusedOps, case: str, page_size: int, head_dim: int,
                                                  group: int) -> None:
    """Decode rows read their pages in place (one kernel call); extend rows keep torch's SDPA."""
    shape = AttentionShape(num_heads=2 * group, num_kv_heads=2, head_dim=head_dim, scaling=head_dim**-0.5)
    mode, lens = CASES[case]
    pool, r2t, batch, q = make_case(shape, mode, lens, page_size, "cpu", dtype=BF16)
    backend = create_attention_backend("torch", shape=shape, kv_pool=pool, req_to_token=r2t)
    backend.init_forward_metadata(batch)
    assert backend._fused is not None and backend._decode == []  # type: ignore[attr-defined]
    before = ops.k.calls
    for layer in range(pool.num_layers):
        got = backend.forward(q, q, q, layer, batch)
        want = reference(shape, pool, r2t, batch, q, layer)
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)
    assert ops.k.calls == before + pool.num_layers


def test_model_with_cpu_kernels_matches_torch_ops(ops: CpuFusedOps, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The whole bf16 decoder (prefill chunks, then decodes; qwen3: per-head norms too) with the
    runner's own choice on CPU (CpuFusedOps) against the same weights on TorchOps."""
    path = str(build_tiny_checkpoint(tmp_path_factory.mktemp("cpuk"), "qwen3", hidden_size=128, num_heads=4,
                                     num_kv_heads=2, num_layers=3))
    fused = PagedHarness(path, page_size=4, dtype="bfloat16", seed=1)
    plain = PagedHarness(path, page_size=4, dtype="bfloat16", seed=1, attention_backend="torch")
    assert isinstance(fused.runner.model.ops, CpuFusedOps)
    plain.runner.model.ops = TorchOps()
    plain.runner.attn_backend._kernels = None  # type: ignore[attr-defined]  # its decode: gather + SDPA
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (5, 13)]
    steps = [(ForwardMode.EXTEND, [(f"r{i}", p) for i, p in enumerate(prompts)])]
    steps += [(ForwardMode.DECODE, [(f"r{i}", [rng.randrange(3, 200)]) for i in range(2)]) for _ in range(4)]
    before = ops.k.calls
    for mode, batch in steps:
        want, got = plain.step_last(mode, batch), fused.step_last(mode, batch)
        assert (got - want).abs().max().item() <= 0.03 * want.abs().max().item()
    # per layer and step: 2 norms, rope + KV write, silu_and_mul, (decode) the attention
    assert ops.k.calls - before >= len(steps) * 3 * 4


def test_fallbacks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """fp32 keeps torch's ops; PDSERVE_CPU_KERNELS=0 keeps them for bf16; no compiler: None."""
    assert type(select_fused_ops(torch.device("cpu"), torch.float32)) is TorchOps
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "0")
    assert type(select_fused_ops(torch.device("cpu"), BF16)) is TorchOps
    monkeypatch.delenv("PDSERVE_CPU_KERNELS")
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    build_cpu_kernels.cache_clear()
    try:
        assert cpu_kernels() is None
        assert not list(tmp_path.glob("*.so"))
    finally:
        build_cpu_kernels.cache_clear()
    assert cpu_kernels_module.ENV_DISABLE == "PDSERVE_CPU_KERNELS"


@pytest.mark.parametrize(("out_features", "in_features", "bias"), [(960, 576, True), (3072, 576, False), (576, 1536, False)])
def test_batch1_linear_reads_the_onednn_packed_weight(ops: CpuFusedOps, out_features: int, in_features: int,
                                                      bias: bool) -> None:
    """One row: gemv_packed_bf16 on PackedLinear's own oneDNN buffer, against oneDNN on the same
    weight; two rows and shapes that are not whole 32 x 32 blocks stay on oneDNN."""
    from common.model.packed_linear import PackedLinear, prepack_supported

    if not prepack_supported(torch.device("cpu"), BF16):
        pytest.skip("no native bf16 here: bf16 weights are not prepacked")
    w, b = _rand(out_features, in_features, seed=8), (_rand(out_features, seed=9) if bias else None)
    linear = PackedLinear(w, b)
    if linear._gemv is None:
        pytest.skip("no AVX512-BF16 (or another packed layout): oneDNN serves batch 1")
    x = _rand(1, in_features, seed=10)
    want = torch.ops.mkldnn._linear_pointwise(x, linear.packed_weight, linear.bias, "none", [], "")
    kernels = linear._gemv
    before = kernels.calls
    got = linear(x)
    assert kernels.calls == before + 1
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2 * want.abs().max().item())
    assert kernels.calls == before + 1
    two = linear(_rand(2, in_features, seed=11))
    assert kernels.calls == before + 1 and two.shape == (2, out_features)
    assert PackedLinear(_rand(100, 64, seed=12), None)._gemv is None
