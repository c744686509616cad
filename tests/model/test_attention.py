"""Attention backends against a float64 reference computed one request at a time."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from common.model.attention import AttentionShape, create_attention_backend, torch_backend
from common.model.attention.torch_backend import MAX_GROUP_KV_ROWS, decode_groups
from tests.model.attention_cases import CASES, make_case, reference

SHAPE = AttentionShape(num_heads=6, num_kv_heads=2, head_dim=8, scaling=8**-0.5)


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
    pool, r2t, batch, q = make_case(SHAPE, mode, lens, page_size, "cpu")
    backend = create_attention_backend("torch", shape=SHAPE, kv_pool=pool, req_to_token=r2t)
    backend.init_forward_metadata(batch)
    for layer in range(pool.num_layers):
        got = backend.forward(q, q, q, layer, batch)  # k/v args unused: the pool already holds them
        want = reference(SHAPE, pool, r2t, batch, q, layer)
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", ["decode", "mixed_groups"])
def test_torch_backend_with_groups_cut_by_the_row_cap(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_backend, "MAX_GROUP_KV_ROWS", 64)  # every long group cut into single rows
    test_torch_backend_matches_reference(case, page_size=4)
