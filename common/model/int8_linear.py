"""Weight-only int8 linears (`--quantization int8`): per-output-channel symmetric int8 weights,
activations stay in the model's dtype, through torch's own int8 matmul kernel
(aten._weight_int8pack_mm, the kernel behind gpt-fast's int8 mode).

Batch-1 decode on CPU streams every weight once per token, so halving the weight bytes
(bf16 -> int8) is what moves it. The kernel pays with bfloat16 activations; with float32
activations it is several times slower than oneDNN's fp32 linear (measured on an AMD EPYC
with avx512_bf16), so the runner refuses float32 on CPU. Never on in parity tests: the
outputs differ from the unquantized model's (top-1 agreement is checked in
tests/model/test_int8_linear.py on the default model).
"""

from __future__ import annotations

import torch
from torch import nn

from common.model.packed_linear import PackedLinear, RowsLinear, prepack_supported, replace_linears

# Up to this many rows the int8 kernel reads half the bytes and wins; above it, its per-row cost
# loses to oneDNN's packed bf16 gemm (bench/engine.py part 4 prints both per batch size).
INT8_MAX_ROWS = 2


def check_quantization(quantization: str | None, device: torch.device, dtype: torch.dtype) -> None:
    """Raises ValueError where `quantization` cannot run (or would only slow the model down)."""
    if quantization is None:
        return
    if quantization != "int8":
        raise ValueError(f"unknown quantization {quantization!r} (int8 is the one there is)")
    if device.type != "cpu":
        raise ValueError("--quantization int8 runs on CPU only so far")
    if dtype != torch.bfloat16:
        raise ValueError("--quantization int8 needs --dtype bfloat16 (its kernel is slower than fp32 linears with "
                         f"float32 activations), got {str(dtype).removeprefix('torch.')}")


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (int8 [out, in], scales [out] in float32): weight ~= q * scale[:, None]."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scales


class Int8Linear(RowsLinear):
    """y = x @ (q * scale)^T + b: up to INT8_MAX_ROWS rows the int8 weight is dequantized inside
    the kernel; above, the same quantized weight, dequantized once at load into act_dtype and
    packed for oneDNN (where the CPU runs act_dtype natively), computes it. Both paths are the
    one quantized model, so a request's outputs do not depend on which batch it ran in beyond
    the rounding every batched kernel has."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, act_dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        q, scales = quantize_per_channel(weight)
        self.weight_int8 = nn.Parameter(q, requires_grad=False)
        self.scales = nn.Parameter(scales.to(act_dtype), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.wide: PackedLinear | None = None
        if prepack_supported(weight.device, act_dtype):
            dequantized = (q.float() * self.scales.float()[:, None]).to(act_dtype)
            self.wide = PackedLinear(dequantized, self.bias)

    def _rows(self, rows: torch.Tensor) -> torch.Tensor:
        if self.wide is not None and rows.shape[0] > INT8_MAX_ROWS:
            return self.wide._rows(rows)
        out: torch.Tensor = torch.ops.aten._weight_int8pack_mm(rows, self.weight_int8, self.scales)
        return out if self.bias is None else out + self.bias


def quantize_linears(model: nn.Module, act_dtype: torch.dtype) -> int:
    """Replace every nn.Linear under `model` by an Int8Linear; returns how many."""
    return replace_linears(model, lambda linear: Int8Linear(linear.weight, linear.bias, act_dtype))
