"""CPU linears through oneDNN with each weight packed once at load ("weight prepacking").

torch's nn.Linear on CPU calls MKL's sgemm/sgemv on the row-major weight. At decode sizes
that is slow: MKL's gemv streams the weights from one core (~13-14 GB/s on a 2-core AVX2
EPYC whose two cores read ~34 GB/s), and small-M gemm re-packs the weight every call. oneDNN's
inner product over a weight reordered once into its blocked layout is parallel and packs
nothing per call. Measured on that box (all 121 linears of SmolLM2-135M, fp32, ms per step):

    rows (batch)     1      8      32     64     256
    nn.Linear        44.6   73.2   118.7  164.9  492.1
    packed oneDNN    28.4   41.7   81.9   138.8  460.3     (bench/engine.py part 4)

In bf16, one row (batch-1 decode) goes through pdserve's gemv_packed_bf16 (cpu_kernels) on
the same packed buffer where it reads oneDNN's layout right (checked per weight at load):
all 121 linears of the default model, 2 threads, weights streamed from memory (Xeon with
AMX): oneDNN 26 ms, the kernel 18.5 ms per step.

This is what inductor's CPU backend does with `freezing` (mkldnn linear + weight prepack),
without compiling anything. Used on CPU for float32, and for bfloat16 only where the CPU
has native bf16 (common.model.config.cpu_has_native_bf16); never on CUDA.

Under --enable-torch-compile the packed weight still serves prefill and every decode batch
of more than COMPILED_TEMPLATE_MAX_ROWS rows (compiled or not); only the compiled steps of
the smallest buckets read the plain weight (kept beside the packed one), which inductor's
C++ GEMM template packs its own way. Measured on the AVX2 EPYC (all 121 linears, fp32, ms; compiled alone):

    rows                                   1      2      4      8      32
    packed oneDNN (this class)             35.7   -      -      59.0   155.4
    inductor C++ GEMM template             23.8   26.8   36.2   66.1   239.1
    inductor freezing, no template (MKL)   39.3   68.3   107.7  155.8  242.9
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from common.model.config import cpu_has_native_bf16
from common.model.cpu_kernels import CpuKernels

# oneDNN picks its blocked layout for this many rows; one packing serves every batch size
# (packed for 32 rows it beat packing for 1 row at every size measured, 1..256).
PACK_BATCH_HINT = 32
# Compiled decode steps of up to this many rows run their linears through inductor's C++ GEMM
# template (on the plain weights); above it oneDNN's packed linear is the faster one.
COMPILED_TEMPLATE_MAX_ROWS = 4


_rows_bucket = threading.local()


def bucket_rows(rows: int, bucket: int) -> int:
    """Rows a packed linear computes for `rows` real ones under `bucket`: the next power of two
    up to `bucket`, then the next multiple of `bucket` (so at most log2(bucket) + max_rows/bucket
    shapes, each one oneDNN primitive per weight shape). bucket 0: rows as they are."""
    if bucket <= 0 or rows <= 0:
        return rows
    if rows >= bucket:
        return -(-rows // bucket) * bucket
    return 1 << (rows - 1).bit_length()


def split_rows(rows: int, bucket: int) -> int:
    """Rows of a first GEMM when splitting `rows` in two computes fewer padded rows than one
    bucket_rows GEMM: the whole multiples of `bucket`, the rest padded on its own (a power of two
    below `bucket`); 0 = no split. Both parts' shapes are bucket_rows shapes, so the set of
    shapes stays bounded. A mixed step of one 256-token chunk + 15 decode rows: 256 + 16 padded
    rows instead of 320 (18% less GEMM work). Splits only where it saves half a bucket or more:
    the second GEMM streams the weight again."""
    if bucket <= 0 or rows <= bucket:
        return 0
    head = rows // bucket * bucket
    # the second GEMM streams the weight once more: worth it only for half a bucket of rows saved
    if head == rows or bucket_rows(rows, bucket) - head - bucket_rows(rows - head, bucket) < bucket // 2:
        return 0
    return head


@contextlib.contextmanager
def padded_rows(bucket: int) -> Iterator[None]:
    """Within this block (this thread only) every PackedLinear pads its rows per bucket_rows (in
    two GEMMs where split_rows says that pads less) and drops the padding from its output: prefill's chunks of any length then run a bounded set of
    GEMM shapes (prefill_server/onednn_cache.py says why that matters). Rows are independent in
    a linear, so the real rows' outputs are those of the unpadded call."""
    before = getattr(_rows_bucket, "value", 0)
    _rows_bucket.value = bucket
    try:
        yield
    finally:
        _rows_bucket.value = before


def prepack_supported(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_has_native_bf16())


class RowsLinear(nn.Module):
    """A linear over the last dim: subclasses compute `_rows(x2d)` for [rows, in_features]."""

    in_features: int
    out_features: int

    def _rows(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] > 0 and x.is_contiguous():  # the decoder's case: no reshape/view ops
            return self._rows(x)
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] == 0:
            return x.new_empty(*lead, self.out_features)
        return self._rows(rows.contiguous()).view(*lead, self.out_features)


class PackedLinear(RowsLinear):
    """y = x @ W^T + b with W in oneDNN's packed layout. The plain weight is dropped, unless
    `keep_plain` (--enable-torch-compile): then traced steps of at most COMPILED_TEMPLATE_MAX_ROWS
    rows compute F.linear on it, for inductor to lower to its GEMM template."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, keep_plain: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed_weight = nn.Parameter(
            torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT), requires_grad=False
        )
        self.plain_weight = nn.Parameter(weight.detach(), requires_grad=False) if keep_plain else None
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self._gemv = _batch1_kernels(self)
        self._gemv_weight: tuple[torch.Tensor, int] | None = None  # (packed_weight, its data pointer)

    def _rows(self, rows: torch.Tensor) -> torch.Tensor:
        compiling = torch.compiler.is_compiling()
        if self.plain_weight is not None and rows.shape[0] <= COMPILED_TEMPLATE_MAX_ROWS and compiling:
            return F.linear(rows, self.plain_weight, self.bias)
        n = rows.shape[0]
        if n == 1 and self._gemv is not None and not compiling:
            return self._batch1(rows, self._gemv)
        bucket = 0 if compiling else getattr(_rows_bucket, "value", 0)
        head = split_rows(n, bucket)
        if head:  # e.g. 271 rows under bucket 64: 256 + 15 (run as 16), not one GEMM of 320
            return torch.cat([self._padded(rows[:head], bucket), self._padded(rows[head:], bucket)])
        return self._padded(rows, bucket)

    def _batch1(self, rows: torch.Tensor, kernels: CpuKernels) -> torch.Tensor:
        """One row through gemv_packed_bf16 on the oneDNN-packed weight itself (no second copy)."""
        if self._gemv_weight is None or self._gemv_weight[0] is not self.packed_weight:  # mkldnn.data_ptr is an op: once
            self._gemv_weight = (self.packed_weight, torch.ops.mkldnn.data_ptr(self.packed_weight))
        out = rows.new_empty(1, self.out_features)
        bias = self.bias.data_ptr() if self.bias is not None else None
        kernels.calls += 1
        rc = kernels.gemv_packed_bf16(rows.data_ptr(), self._gemv_weight[1], bias,
                                      out.data_ptr(), self.in_features, self.out_features, torch.get_num_threads())
        assert rc == 0, "gemv_packed_bf16 refused a weight it passed _batch1_kernels with"
        return out

    def _padded(self, rows: torch.Tensor, bucket: int) -> torch.Tensor:
        n = rows.shape[0]
        padded = bucket_rows(n, bucket)
        if padded != n:
            rows = torch.cat([rows, rows.new_zeros(padded - n, rows.shape[1])])
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")
        return out if padded == n else out[:n]


def _batch1_kernels(linear: PackedLinear) -> CpuKernels | None:
    """pdserve's batch-1 kernel for this bf16 packed weight, when it reads oneDNN's layout right:
    checked once against oneDNN on a random row (a layout it does not know is off by O(1);
    accumulation order by a few bf16 ulps). None: oneDNN serves batch 1 too."""
    w = linear.packed_weight
    if w.dtype != torch.bfloat16 or linear.in_features % 32 or linear.out_features % 32:
        return None
    from common.model.cpu_kernels import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None or torch.ops.mkldnn._nbytes(w) != 2 * linear.in_features * linear.out_features:
        return None
    x = torch.randn(1, linear.in_features, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    want = torch.ops.mkldnn._linear_pointwise(x, w, linear.bias, "none", [], "").float()
    out = torch.empty(1, linear.out_features, dtype=torch.bfloat16)
    bias = linear.bias.data_ptr() if linear.bias is not None else None
    rc = kernels.gemv_packed_bf16(x.data_ptr(), torch.ops.mkldnn.data_ptr(w), bias, out.data_ptr(),
                                  linear.in_features, linear.out_features, 1)
    if rc != 0:
        return None
    err = (out.float() - want).abs().max().item()
    return kernels if err <= 2e-2 * max(1.0, want.abs().max().item()) else None


def replace_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> int:
    """Replace every nn.Linear under `model` by make(linear); returns how many."""
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, make(linear))
    return len(targets)


def prepack_linears(model: nn.Module, keep_plain: bool = False) -> int:
    """Replace every nn.Linear under `model` by a PackedLinear; returns how many."""
    return replace_linears(model, lambda linear: PackedLinear(linear.weight, linear.bias, keep_plain))
