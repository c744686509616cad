"""fused_ops on CPU for bf16 activations: each op one call into cpu_kernels (kernels.c).

    op                   torch (TorchOps)                  here
    add_rms_norm         add, to, pow, mean, rsqrt, mul,   one pass per row, in place (as
                         to, mul: ~8 operators             flashinfer: x <- norm, residual <- sum)
    rms_norm             ~6 operators                      one call
    silu_and_mul         chunk, silu, mul                  one call
    rope_kv              to, mul, roll, mul, add, to per   q and k rotated in place and this
                         tensor + 2 index_copy_ (KV write) step's K/V written to the pool: one call

Every op falls back to TorchOps when its inputs are not what the kernel takes (another dtype,
non-contiguous rows) and inside torch.compile tracing (a ctypes call is opaque to dynamo; the
compiled step keeps torch's ops, which inductor fuses itself). fp32 never comes here: the
exact-parity path stays torch's (select_fused_ops).
"""

from __future__ import annotations

import torch

from common.cache.kv_pool import KVPool
from common.model.cpu_kernels import CpuKernels
from common.model.fused_ops import TorchOps
from common.model.rope import RopeTable

BF16 = torch.bfloat16


def _rows_ok(x: torch.Tensor, head_dim: int) -> bool:
    """[T, H, D] with contiguous heads (rows may be strided: views into the qkv output)."""
    return x.dim() == 3 and x.dtype == BF16 and x.stride(2) == 1 and x.stride(1) == head_dim


class CpuFusedOps(TorchOps):
    name = "cpu_kernels"

    def __init__(self, kernels: CpuKernels) -> None:
        self.k = kernels

    def _eager(self, *tensors: torch.Tensor) -> bool:
        return not torch.compiler.is_compiling() and all(t.dtype == BF16 and t.device.type == "cpu" for t in tensors)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not (self._eager(x, weight) and x.is_contiguous()) or x.numel() == 0:
            return super().rms_norm(x, weight, eps)
        out = torch.empty_like(x)
        h = x.shape[-1]
        self.k.calls += 1
        self.k.rms_norm_bf16(x.data_ptr(), out.data_ptr(), weight.data_ptr(), x.numel() // h, h, eps,
                             torch.get_num_threads())
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """In place: residual <- x + residual, x <- rms_norm(residual) (both are the caller's
        fresh activations; the model never reads the old values again)."""
        ok = self._eager(x, residual, weight) and x.is_contiguous() and residual.is_contiguous()
        if not ok or x.shape != residual.shape or x.numel() == 0:
            return super().add_rms_norm(x, residual, weight, eps)
        h = x.shape[-1]
        self.k.calls += 1
        self.k.add_rms_norm_bf16(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), x.numel() // h, h, eps,
                                 torch.get_num_threads())
        return x, residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not (self._eager(gate_up) and gate_up.is_contiguous()) or gate_up.numel() == 0:
            return super().silu_and_mul(gate_up)
        i = gate_up.shape[-1] // 2
        out = gate_up.new_empty(*gate_up.shape[:-1], i)
        self.k.calls += 1
        self.k.silu_mul_bf16(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * i), i, torch.get_num_threads())
        return out

    def rope(self, q: torch.Tensor, k: torch.Tensor, table: RopeTable) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = self.rope_kv(q, k, None, table, None, 0, None)
        return q, k

    def rope_kv(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, table: RopeTable, pool: KVPool | None,
        layer: int, slots: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        d = q.shape[-1]
        ok = self._eager(q, k) and _rows_ok(q, d) and _rows_ok(k, d) and q.shape[0] == k.shape[0] > 0
        ok = ok and table.cos_sin_cache.dtype == torch.float32 and table.cos_sin_cache.is_contiguous()
        write = pool is not None and v is not None and slots is not None
        if write:
            assert pool is not None and v is not None and slots is not None
            ok = ok and pool.dtype == BF16 and pool.device.type == "cpu" and _rows_ok(v, d) and v.shape == k.shape
        if not ok:  # TorchOps' rope (not self.rope: that comes back here), the caller writes K/V
            q, k = TorchOps.rope(self, q, k, table)
            return q, k, False
        positions = table.positions if table.positions.dtype == torch.int64 else table.positions.long()
        positions = positions.contiguous()
        if write:
            assert pool is not None and v is not None and slots is not None
            slots = slots if slots.dtype == torch.int64 and slots.is_contiguous() else slots.long().contiguous()
        self.k.calls += 1
        self.k.rope_kv_bf16(
            q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0),
            v.data_ptr() if write else None, v.stride(0) if write else 0,  # type: ignore[union-attr]
            q.shape[0], q.shape[1], k.shape[1], d, positions.data_ptr(), table.cos_sin_cache.data_ptr(),
            pool.kv.data_ptr() if write else None, slots.data_ptr() if write else None,  # type: ignore[union-attr]
            pool.num_layers if write else 0, pool.page_size if write else 1, layer,  # type: ignore[union-attr]
            torch.get_num_threads(),
        )
        return q, k, write
