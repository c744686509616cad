"""Weight-only int8 linears (`--quantization int8`): per-output-channel symmetric int8 weights
through torch's own int8 matmul kernel (aten._weight_int8pack_mm, the kernel behind gpt-fast's
int8 mode), which takes bfloat16 activations.

Batch-1 decode on CPU streams every weight once per token, so cutting the weight bytes (bf16 ->
int8: 2x, fp32 -> int8: 4x) is what moves it. With a bfloat16 model the kernel gets the
activations as they are; with a float32 model (CPUs without native bf16) the few rows it runs
are rounded to bfloat16 on the way in and the output goes back to float32. Measured on an AVX2
EPYC, all 121 linears of SmolLM2-135M at 1 row: fp32 packed oneDNN 35.7 ms, this kernel
21.2 ms eager, 13.4 ms inside an inductor-compiled step (fp32 GEMM template: 23.8 ms).
Never on in parity tests: the outputs differ from the unquantized model's (top-1 agreement is
checked in tests/model/test_int8_linear.py on the default model).
"""

from __future__ import annotations

import torch
from torch import nn

from common.model.packed_linear import PackedLinear, RowsLinear, prepack_supported, replace_linears

# Up to this many rows the int8 kernel reads fewer bytes and wins; above it, its per-row cost
# loses to oneDNN's packed gemm (bench/engine.py part 4 prints both per batch size).
INT8_MAX_ROWS = 2
KERNEL_DTYPE = torch.bfloat16  # the activations _weight_int8pack_mm computes with


def check_quantization(quantization: str | None, device: torch.device, dtype: torch.dtype) -> None:
    """Raises ValueError where `quantization` cannot run."""
    if quantization is None:
        return
    if quantization != "int8":
        raise ValueError(f"unknown quantization {quantization!r} (int8 is the one there is)")
    if device.type != "cpu":
        raise ValueError("--quantization int8 runs on CPU only so far")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"--quantization int8 needs --dtype float32 or bfloat16, got {str(dtype).removeprefix('torch.')}")


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (int8 [out, in], scales [out] in float32): weight ~= q * scale[:, None]."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scales


class Int8Linear(RowsLinear):
    """y = x @ (q * scale)^T + b: up to INT8_MAX_ROWS rows the int8 weight is dequantized inside
    the kernel (rows in KERNEL_DTYPE); above, the same quantized weight, dequantized once at load into act_dtype and
    packed for oneDNN (where the CPU runs act_dtype natively), computes it. Both paths are the
    one quantized model, so a request's outputs do not depend on which batch it ran in beyond
    the rounding every batched kernel has."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, act_dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        q, scales = quantize_per_channel(weight)
        self.weight_int8 = nn.Parameter(q, requires_grad=False)
        self.act_dtype = act_dtype
        self.scales = nn.Parameter(scales.to(KERNEL_DTYPE), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.wide: PackedLinear | None = None
        if prepack_supported(weight.device, act_dtype):
            dequantized = (q.float() * self.scales.float()[:, None]).to(act_dtype)
            self.wide = PackedLinear(dequantized, self.bias)

    def _rows(self, rows: torch.Tensor) -> torch.Tensor:
        if self.wide is not None and rows.shape[0] > INT8_MAX_ROWS:
            return self.wide._rows(rows)
        out: torch.Tensor = torch.ops.aten._weight_int8pack_mm(rows.to(KERNEL_DTYPE), self.weight_int8, self.scales)
        out = out.to(self.act_dtype)
        return out if self.bias is None else out + self.bias


def quantize_linears(model: nn.Module, act_dtype: torch.dtype) -> int:
    """Replace every nn.Linear under `model` by an Int8Linear; returns how many."""
    return replace_linears(model, lambda linear: Int8Linear(linear.weight, linear.bias, act_dtype))
