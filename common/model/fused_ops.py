"""The decoder's elementwise ops: plain torch, or flashinfer's fused kernels on a GPU.

    rms_norm(x, w)                   weight * rmsnorm(x)                 (fp32 math)
    rope(q, k, table)                q, k rotated (rope.py's RopeTable)   (fp32 math)
    add_rms_norm(x, residual, w)     residual' = x + residual; (rms_norm(residual', w), residual')
    silu_and_mul(gate_up)            silu(gate) * up, gate_up = [gate | up] on the last axis
    rope_kv(q, k, v, table, pool, layer, slots)
                                     rope, and where the implementation can, this step's K/V
                                     written to the pool too (returns written: the caller
                                     writes them itself when False)

Three implementations: TorchOps is the reference and runs everywhere (the fp32 parity tests).
On CUDA with flashinfer installed and fp16/bf16 activations, FlashInferOps runs each as one
kernel (fused_add_rmsnorm works in place: x and residual are overwritten), where torch needs
3-6 launches. On CPU with bf16 activations, CpuFusedOps (cpu_fused_ops.py) runs each as one
call into pdserve's C kernels (cpu_kernels/), in place like flashinfer's, rope_kv included.
Callers must treat add_rms_norm's and rope's inputs as consumed (they may be overwritten).
"""

from __future__ import annotations

import importlib.util
import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from common.model.rope import RopeTable, RotaryEmbedding

if TYPE_CHECKING:
    from common.cache.kv_pool import KVPool

logger = logging.getLogger(__name__)

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

    def rope(self, q: torch.Tensor, k: torch.Tensor, table: RopeTable) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hk, D] rotated at table.positions (new tensors or, fused, in place)."""
        return table.apply(q, k)

    def rope_kv(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, table: RopeTable, pool: KVPool | None,
        layer: int, slots: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """rope(q, k) and, where this implementation fuses it, K/V written to `pool` at `slots`
        of `layer`: (q, k, written). Here nothing is written: the caller writes them."""
        q, k = self.rope(q, k, table)
        return q, k, False

    def check(self, rope: RotaryEmbedding, num_heads: int, num_kv_heads: int, device: torch.device,
              dtype: torch.dtype) -> None:
        """Once, before the first forward: fused kernels agree with the torch reference."""


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

    fused_rope = True  # until check() finds the kernel disagreeing with the reference

    def rope(self, q: torch.Tensor, k: torch.Tensor, table: RopeTable) -> tuple[torch.Tensor, torch.Tensor]:
        """One kernel for q and k, in place (q and k may be strided views of the qkv output)."""
        if not self.fused_rope or q.dtype not in FUSED_DTYPES:
            return super().rope(q, k, table)
        n, _, head_dim = q.shape
        self.fi.apply_rope_with_cos_sin_cache_inplace(
            positions=table.positions, query=q.view(n, -1), key=k.view(n, -1), head_size=head_dim,
            cos_sin_cache=table.cos_sin_cache, is_neox=True,
        )
        return q, k

    def check(self, rope: RotaryEmbedding, num_heads: int, num_kv_heads: int, device: torch.device,
              dtype: torch.dtype) -> None:
        """The fused rope against RopeTable.apply on random q/k at a few positions (a layout
        mismatch is off by O(1), rounding by a few bf16 ulps); on disagreement, torch's rope."""
        head_dim = rope.cos_sin_cache.shape[-1]
        gen = torch.Generator(device=device).manual_seed(0)
        positions = torch.tensor([0, 1, 7, rope.context_length - 1], device=device)
        q = torch.randn(4, num_heads, head_dim, device=device, generator=gen).to(dtype)
        k = torch.randn(4, num_kv_heads, head_dim, device=device, generator=gen).to(dtype)
        table = rope.table(positions)
        want_q, want_k = table.apply(q, k)
        try:
            got_q, got_k = self.rope(q.clone(), k.clone(), table)
            ok = all(torch.allclose(a.float(), b.float(), atol=6e-2, rtol=2e-2)
                     for a, b in ((got_q, want_q), (got_k, want_k)))
        except Exception as e:  # an API this flashinfer does not have
            logger.warning("flashinfer rope failed (%s); using torch's", e)
            ok = None
        if ok is False:
            logger.warning("flashinfer rope disagrees with the reference; using torch's")
        self.fused_rope = bool(ok)


def select_fused_ops(device: torch.device, dtype: torch.dtype) -> TorchOps:
    """flashinfer's kernels for fp16/bf16 where flashinfer is installed and runs on `device`
    (CUDA); else pdserve's C kernels on CPU for bf16 where they build (cpu_kernels, off with
    PDSERVE_CPU_KERNELS=0); torch otherwise (fp32 always)."""
    if dtype not in FUSED_DTYPES:
        return TorchOps()
    if importlib.util.find_spec("flashinfer") is not None:
        import flashinfer

        if device.type in getattr(flashinfer, "PDSERVE_DEVICE_TYPES", ("cuda",)):
            return FlashInferOps(flashinfer)
    if device.type == "cpu" and dtype == torch.bfloat16:
        from common.model.cpu_kernels import cpu_kernels

        kernels = cpu_kernels()
        if kernels is not None:
            from common.model.cpu_fused_ops import CpuFusedOps

            return CpuFusedOps(kernels)
    return TorchOps()
