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


def test_bucket_rows_powers_of_two_then_multiples() -> None:
    got = [packed_linear.bucket_rows(n, 64) for n in (1, 2, 3, 5, 33, 63, 64, 65, 129, 500)]
    assert got == [1, 2, 4, 8, 64, 64, 64, 128, 192, 512]
    assert packed_linear.bucket_rows(37, 0) == 37
    shapes = {packed_linear.bucket_rows(n, 64) for n in range(1, 8193)}
    assert len(shapes) == 6 + 8192 // 64  # 1..32, then one per multiple of 64


def test_split_rows_only_where_it_saves_half_a_bucket() -> None:
    got = {n: packed_linear.split_rows(n, 64) for n in (1, 64, 65, 100, 271, 300, 527, 600)}
    assert got == {1: 0, 64: 0, 65: 64, 100: 0, 271: 256, 300: 0, 527: 512, 600: 576}
    assert packed_linear.split_rows(271, 0) == 0
    for n in range(1, 2049):  # both parts are bucket_rows shapes
        head = packed_linear.split_rows(n, 64)
        if head:
            assert head % 64 == 0 and 0 < n - head < 64


@needs_mkldnn
def test_split_rows_run_two_gemms_with_the_same_numbers() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 96)
    packed = PackedLinear(linear.weight, linear.bias)
    x = torch.randn(271, 64)
    got: list[torch.Tensor] = []

    def padded() -> None:
        with torch.inference_mode(), packed_linear.padded_rows(64):
            got.append(packed(x))

    with torch.inference_mode():
        want = packed(x)
    assert linear_rows_run(padded) == [256, 16]
    assert torch.equal(got[0], want)


def linear_rows_run(fn: object) -> list[int]:
    """Row counts oneDNN's packed linear ran on while fn() ran (the profiler records real op inputs)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()  # type: ignore[operator]
    return [e.input_shapes[0][0] for e in prof.events() if e.name == "mkldnn::_linear_pointwise"]


@needs_mkldnn
@pytest.mark.parametrize("rows", [1, 3, 37, 64, 100])
def test_padded_rows_runs_bucketed_shapes_and_returns_the_same_numbers(rows: int) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(64, 96)
    packed = PackedLinear(linear.weight, linear.bias)
    x = torch.randn(rows, 64)
    got: list[torch.Tensor] = []

    def padded() -> None:
        with torch.inference_mode(), packed_linear.padded_rows(64):
            got.append(packed(x))

    with torch.inference_mode():
        want = packed(x)
    assert linear_rows_run(padded) == [packed_linear.bucket_rows(rows, 64)]
    assert got[0].shape == (rows, 96)
    assert torch.equal(got[0], want)  # rows are independent: bit for bit
    assert linear_rows_run(lambda: packed(x)) == [rows]  # outside the block: unpadded again


@needs_mkldnn
def test_runner_pads_extend_rows_only_and_keeps_the_logits(tiny_llama_path: str) -> None:
    from common.model.forward_batch import ForwardMode
    from tests.model.harness import PagedHarness

    h = PagedHarness(tiny_llama_path, page_size=4)
    assert h.runner.weights_prepacked
    prompt = [(7 * i) % 300 + 3 for i in range(37)]
    want = h.step_last(ForwardMode.EXTEND, [("plain", prompt)])
    h.runner.prefill_row_bucket = 64
    got: list[torch.Tensor] = []
    extend_rows = linear_rows_run(lambda: got.append(h.step_last(ForwardMode.EXTEND, [("padded", prompt)])))
    assert torch.equal(got[0], want)
    assert set(extend_rows[:-1]) == {64} and extend_rows[-1] == 1  # the head runs on the last token only
    decode_rows = linear_rows_run(lambda: h.step_last(ForwardMode.DECODE, [("plain", [5]), ("padded", [5])]))
    assert set(decode_rows) == {2}
