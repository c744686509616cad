"""oneDNN weight-prepacked linears (common/model/packed_linear.py): same numbers as nn.Linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from common.model import packed_linear
from common.model.packed_linear import PackedLinear, prepack_linears, prepack_supported

needs_mkldnn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@needs_mkldnn
@pytest.mark.parametrize("rows", [0, 1, 3, 32, 70])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(48, 40, bias=bias)
    packed = PackedLinear(linear.weight, linear.bias)
    x = torch.randn(rows, 48)
    with torch.inference_mode():
        got, want = packed(x), F.linear(x, linear.weight, linear.bias)
    assert got.shape == want.shape == (rows, 40)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_mkldnn
def test_prepack_replaces_every_linear_and_keeps_leading_dims() -> None:
    model = nn.Sequential(nn.Linear(16, 24), nn.SiLU(), nn.Sequential(nn.Linear(24, 8, bias=False)))
    x = torch.randn(2, 5, 16)
    with torch.inference_mode():
        want = model(x)
        assert prepack_linears(model) == 2
        got = model(x)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_prepack_only_where_the_dtype_is_native(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert not prepack_supported(torch.device("meta"), torch.float32)
    assert not prepack_supported(cpu, torch.float16)
    monkeypatch.setattr(packed_linear, "cpu_has_native_bf16", lambda: False)
    assert not prepack_supported(cpu, torch.bfloat16)
    assert prepack_supported(cpu, torch.float32) == torch.backends.mkldnn.is_available()
