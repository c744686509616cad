"""bf16/fp16 extends on CPU run SDPA at padded shapes, so torch's never-evicted per-thread cache of
brgemm kernels (at::native::cpublas::Brgemm) stops growing with every new prompt length.

The heap test measures that cache where torch uses it (bf16 flash attention through oneDNN's
brgemm: CPUs with AVX-512, e.g. the Intel Xeon AMX CI box); elsewhere nothing grows either way.
"""

from __future__ import annotations

import ctypes
import random

import pytest
import torch
import torch.nn.functional as F

from common.cache.kv_pool import KVPool
from common.model.attention import create_attention_backend, torch_backend
from common.model.attention.base import AttentionBackend
from common.model.attention.torch_backend import REDUCED_PRECISION_EXTEND_PAD, extend_pad_rows
from common.model.forward_batch import ForwardBatch, ForwardMode
from common.server.heap_trim import load_malloc_trim
from tests.model.attention_cases import gqa_shape, make_case, reference

SHAPE = gqa_shape(head_dim=64, group=3)  # the default model's attention: 9 heads over 3 KV heads of 64
PAD = REDUCED_PRECISION_EXTEND_PAD


def extend_case(
    requests: list[tuple[int, int]], dtype: torch.dtype
) -> tuple[AttentionBackend, KVPool, torch.Tensor, ForwardBatch, torch.Tensor]:
    """(backend with its metadata built, pool, req_to_token, batch, q) for (prefix, extend) requests."""
    pool, r2t, batch, q = make_case(SHAPE, ForwardMode.EXTEND, requests, 16, "cpu", dtype)
    backend = create_attention_backend("torch", shape=SHAPE, kv_pool=pool, req_to_token=r2t)
    backend.init_forward_metadata(batch)
    return backend, pool, r2t, batch, q


def run_extend(requests: list[tuple[int, int]], dtype: torch.dtype) -> None:
    backend, _, _, batch, q = extend_case(requests, dtype)
    backend.forward(q, q, q, 0, batch)


def test_pad_applies_to_reduced_precision_on_cpu_only() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert extend_pad_rows(cpu, torch.bfloat16) == extend_pad_rows(cpu, torch.float16) == PAD > 1
    assert extend_pad_rows(cpu, torch.float32) == 1  # fp32 keeps its exact, unpadded path
    assert extend_pad_rows(cuda, torch.bfloat16) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sdpa_sees_padded_extend_shapes(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[int, int]] = []
    sdpa = F.scaled_dot_product_attention

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: object) -> torch.Tensor:
        seen.append((q.shape[-2], k.shape[-2]))
        return sdpa(q, k, v, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(torch_backend.F, "scaled_dot_product_attention", spy)
    requests = [(0, 7), (5, 9), (16, 3), (0, 70), (100, 65)]
    run_extend(requests, dtype)
    if dtype == torch.float32:
        assert seen == [(e, p + e) for p, e in requests]
    else:
        assert seen == [(64, 64), (64, 64), (64, 64), (128, 128), (128, 192)]


@pytest.mark.parametrize("requests", [[(0, 7), (5, 9), (0, 1), (16, 3)], [(0, 130), (70, 61), (200, 2)]])
def test_padded_bf16_extends_match_the_reference(requests: list[tuple[int, int]]) -> None:
    backend, pool, r2t, batch, q = extend_case(requests, torch.bfloat16)
    for layer in range(pool.num_layers):
        got = backend.forward(q, q, q, layer, batch)
        assert torch.isfinite(got).all()
        want = reference(SHAPE, pool, r2t, batch, q, layer)
        torch.testing.assert_close(got.double(), want, rtol=0, atol=3e-2)  # bf16 rounding of q/K/V and out


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_in_use_mib() -> float:
    """glibc's in-use bytes over all arenas, after giving the free pages back."""
    trim = load_malloc_trim()
    assert trim is not None, "glibc only"
    trim(0)
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**20


def test_new_extend_lengths_build_no_new_attention_kernels() -> None:
    """A second pass over 48 prompt lengths never seen before, inside the padded shapes the first
    pass built, adds no kernels. Unpadded (REDUCED_PRECISION_EXTEND_PAD = 1) it adds ~90 KiB of
    kernels per new length on the Intel Xeon AMX box (3.8 MiB in this test)."""
    rng = random.Random(0)
    lengths = rng.sample(range(2, 190), 96)
    with torch.inference_mode():
        for e in lengths[:48]:
            run_extend([(0, e), (rng.randrange(1, 60), e)], torch.bfloat16)
        before = heap_in_use_mib()
        for e in lengths[48:]:
            run_extend([(0, e), (rng.randrange(1, 60), e)], torch.bfloat16)
        grown = heap_in_use_mib() - before
    assert grown < 1.0, f"in-use C heap grew {grown:.2f} MiB over 48 new extend lengths"
