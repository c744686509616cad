"""The decoder's elementwise ops: plain torch, or flashinfer's fused kernels on a GPU.

    rms_norm(x, w)                   weight * rmsnorm(x)                 (fp32 math)
    add_rms_norm(x, residual, w)     residual' = x + residual; (rms_norm(residual', w), residual')
    silu_and_mul(gate_up)            silu(gate) * up, gate_up = [gate | up] on the last axis

On CUDA with flashinfer installed and fp16/bf16 activations, FlashInferOps runs each as one
kernel (fused_add_rmsnorm works in place: x and residual are overwritten), where torch needs
3-6 launches. TorchOps is the reference and runs everywhere (the fp32 parity tests).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.nn.functional as F

FUSED_DTYPES = (torch.float16, torch.bfloat16)


class TorchOps:
    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype == torch.float32:  # no conversions to launch (the same numbers)
            return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + x
        return self.rms_norm(residual, weight, eps), residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class FlashInferOps(TorchOps):
    name = "flashinfer"

    def __init__(self, flashinfer: Any) -> None:
        self.fi = flashinfer

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() != 2:  # per-head norms (qk_norm): the kernel takes [tokens, hidden]
            return super().rms_norm(x, weight, eps)
        out: torch.Tensor = self.fi.rmsnorm(x.contiguous(), weight, eps)
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = x.contiguous(), residual.contiguous()
        self.fi.fused_add_rmsnorm(x, residual, weight, eps)  # residual += x; x = rmsnorm(residual) * weight
        return x, residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fi.silu_and_mul(gate_up.contiguous())
        return out


def select_fused_ops(device: torch.device, dtype: torch.dtype) -> TorchOps:
    """flashinfer's kernels on CUDA for fp16/bf16 when flashinfer is installed, torch otherwise."""
    if dtype not in FUSED_DTYPES or importlib.util.find_spec("flashinfer") is None:
        return TorchOps()
    import flashinfer

    if device.type not in getattr(flashinfer, "PDSERVE_DEVICE_TYPES", ("cuda",)):
        return TorchOps()
    return FlashInferOps(flashinfer)
