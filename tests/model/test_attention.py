"""Attention backends against a float64 reference computed one request at a time."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from common.cache.kv_pool import KVPool
from common.model.attention import AttentionShape, create_attention_backend, torch_backend
from common.model.attention.torch_backend import MAX_GROUP_KV_ROWS, decode_groups
from common.model.forward_batch import ForwardBatch, ForwardMode

SHAPE = AttentionShape(num_heads=6, num_kv_heads=2, head_dim=8, scaling=8**-0.5)


def make_case(
    mode: ForwardMode,
    prefix_and_extend: list[tuple[int, int]],
    page_size: int,
    device: str,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[KVPool, torch.Tensor, ForwardBatch, torch.Tensor]:
    """A pool with random K/V, scattered pages per request, and a batch over them; returns q too."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    pool = KVPool(
        num_layers=2, num_pages=1024, page_size=page_size, num_kv_heads=SHAPE.num_kv_heads,
        head_dim=SHAPE.head_dim, dtype=dtype, device=device,
    )
    for buf in pool.k_buffers + pool.v_buffers:
        buf.normal_()
    req_to_token = torch.zeros(8, 512, dtype=torch.int32, device=device)
    pages = list(range(1, pool.num_pages))
    rng.shuffle(pages)
    ids, positions, out_loc, rows, seq_lens, prefix_lens = [], [], [], [], [], []
    for r, (prefix, extend) in enumerate(prefix_and_extend):
        row = 7 - r
        seq = prefix + extend
        own = [pages.pop() for _ in range((seq + page_size - 1) // page_size)]
        slots = [own[i // page_size] * page_size + i % page_size for i in range(seq)]
        req_to_token[row, :seq] = torch.tensor(slots, dtype=torch.int32)
        ids += [1] * extend
        positions += list(range(prefix, seq))
        out_loc += slots[prefix:]
        rows.append(row)
        seq_lens.append(seq)
        prefix_lens.append(prefix)
    batch = ForwardBatch.build(mode, ids, positions, out_loc, rows, seq_lens, prefix_lens, device=device)
    q = torch.randn(len(ids), SHAPE.num_heads, SHAPE.head_dim, device=device, dtype=dtype)
    return pool, req_to_token, batch, q


def reference(pool: KVPool, req_to_token: torch.Tensor, batch: ForwardBatch, q: torch.Tensor, layer: int):
    out = []
    start = 0
    group = SHAPE.num_heads // SHAPE.num_kv_heads
    for r in range(batch.batch_size):
        p, e, s = batch.prefix_lens_cpu[r], batch.extend_lens_cpu[r], batch.seq_lens_cpu[r]
        slots = req_to_token[batch.req_pool_indices[r], :s].long()
        k = pool.k_buffers[layer][slots].double().repeat_interleave(group, dim=1)  # [s, H, D]
        v = pool.v_buffers[layer][slots].double().repeat_interleave(group, dim=1)
        qq = q[start : start + e].double()
        scores = torch.einsum("ehd,shd->hes", qq, k) * SHAPE.scaling
        allowed = torch.arange(s)[None, :] <= (p + torch.arange(e))[:, None]
        scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
        out.append(torch.einsum("hes,shd->ehd", scores.softmax(-1), v).reshape(e, -1))
        start += e
    return torch.cat(out)


CASES = {
    "extend": (ForwardMode.EXTEND, [(0, 7), (5, 9), (0, 1), (16, 3)]),
    "decode": (ForwardMode.DECODE, [(0, 1), (12, 1), (40, 1), (3, 1)]),
    "mixed": (ForwardMode.MIXED, [(10, 1), (0, 20), (33, 1), (2, 5)]),
    # decode rows of very different lengths: several length groups (see decode_groups)
    "decode_groups": (ForwardMode.DECODE, [(0, 1), (400, 1), (3, 1), (120, 1), (5, 1), (250, 1)]),
    "mixed_groups": (ForwardMode.MIXED, [(400, 1), (0, 20), (3, 1), (120, 1), (2, 5), (250, 1)]),
}


def test_grouped_cases_form_several_groups() -> None:
    for case in ("decode_groups", "mixed_groups"):
        seq_lens = [p + e for p, e in CASES[case][1] if e == 1]
        assert len(decode_groups(seq_lens)) >= 2, case


@given(st.lists(st.integers(1, 3000), min_size=1, max_size=300))
def test_decode_groups_partition_rows_within_the_cap(lengths: list[int]) -> None:
    groups = decode_groups(lengths)
    assert sorted(r for g in groups for r in g) == list(range(len(lengths)))
    for g in groups:
        assert g and (len(g) == 1 or len(g) * max(lengths[r] for r in g) <= MAX_GROUP_KV_ROWS)
    if len(groups) == 1:
        assert groups[0] == list(range(len(lengths)))  # one group keeps the batch order


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("case", list(CASES))
def test_torch_backend_matches_reference(case: str, page_size: int) -> None:
    mode, lens = CASES[case]
    pool, r2t, batch, q = make_case(mode, lens, page_size, "cpu")
    backend = create_attention_backend("torch", shape=SHAPE, kv_pool=pool, req_to_token=r2t)
    backend.init_forward_metadata(batch)
    for layer in range(pool.num_layers):
        got = backend.forward(q, q, q, layer, batch)  # k/v args unused: the pool already holds them
        want = reference(pool, r2t, batch, q, layer)
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", ["decode", "mixed_groups"])
def test_torch_backend_with_groups_cut_by_the_row_cap(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_backend, "MAX_GROUP_KV_ROWS", 64)  # every long group cut into single rows
    test_torch_backend_matches_reference(case, page_size=4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", list(CASES))
def test_flashinfer_matches_torch(case: str, page_size: int) -> None:
    pytest.importorskip("flashinfer")
    mode, lens = CASES[case]
    pool, r2t, batch, q = make_case(mode, lens, page_size, "cuda", torch.bfloat16)
    outs = []
    for name in ("torch", "flashinfer"):
        backend = create_attention_backend(name, shape=SHAPE, kv_pool=pool, req_to_token=r2t)
        backend.init_forward_metadata(batch)
        outs.append(backend.forward(q, q, q, 0, batch))
    torch.testing.assert_close(outs[1].float(), outs[0].float(), rtol=2e-2, atol=2e-2)
