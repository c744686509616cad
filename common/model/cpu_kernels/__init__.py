"""pdserve's fused CPU kernels (kernels.c), compiled once per machine with the system C compiler.

    cpu_kernels()  -> CpuKernels | None     the loaded library, or None (no compiler, a failed
                                            build, PDSERVE_CPU_KERNELS=0): callers keep torch

Why C through ctypes and not a torch C++ extension: kernels.c includes no torch header, so it
builds in ~1-2 s with `cc -O3 -march=native -fopenmp` (a torch extension compiles ATen's
headers: ~30-60 s on a 2-core box, too slow for a fresh CI machine), and a ctypes call costs
about what one torch operator's dispatch does while doing the work of 3-15 of them. The
library links the libgomp that torch already loaded (same soname), so its OpenMP threads are
torch's pool, not a second one.

The build lands in $PDSERVE_KERNEL_CACHE (default ~/.cache/pdserve/cpu_kernels), named by a
hash of the source, the flags, the compiler and this CPU's flags: a fresh clone on the same
machine, or a CI cache of that folder, finds it; a different CPU or source builds its own.
Writes go to a temporary file renamed into place, so processes building at once do not clash.

Who owns what: this module owns building and loading; fused_ops.CpuFusedOps (elementwise ops,
rope + KV write) and attention/torch_backend.py (paged decode attention) own when to call.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
ABI_VERSION = 1
ENV_DISABLE = "PDSERVE_CPU_KERNELS"  # "0": never build or load (torch paths everywhere)
ENV_CACHE = "PDSERVE_KERNEL_CACHE"
BUILD_TIMEOUT_S = 120

_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float
_N = ctypes.c_int
SIGNATURES: dict[str, list[type]] = {
    "add_rms_norm_bf16": [_P, _P, _P, _I, _I, _F, _N],
    "rms_norm_bf16": [_P, _P, _P, _I, _I, _F, _N],
    "silu_mul_bf16": [_P, _P, _I, _I, _N],
    "rope_kv_bf16": [_P, _I, _P, _I, _P, _I, _I, _I, _I, _I, _P, _P, _P, _P, _I, _I, _I, _N],
    "decode_attention_bf16": [_P, _I, _P, _P, _P, _I, _N, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _F, _N],
    "gemv_packed_bf16": [_P, _P, _P, _P, _I, _I, _N],
}
RETURNS_INT = ("decode_attention_bf16", "gemv_packed_bf16")


class CpuKernels:
    """The loaded library: one attribute per kernel (ctypes functions with their argtypes set).
    `calls` counts kernel calls made through the wrappers (bench/step_ops.py reports it beside
    torch's operator count, which does not see them)."""

    add_rms_norm_bf16: Callable[..., None]
    rms_norm_bf16: Callable[..., None]
    silu_mul_bf16: Callable[..., None]
    rope_kv_bf16: Callable[..., None]
    decode_attention_bf16: Callable[..., int]
    gemv_packed_bf16: Callable[..., int]

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.lib = lib
        self.path = path
        self.calls = 0
        for name, args in SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = ctypes.c_int if name in RETURNS_INT else None
            setattr(self, name, fn)


def _cache_dir() -> Path:
    return Path(os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "pdserve" / "cpu_kernels")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\n".join([SOURCE.read_text(), " ".join(FLAGS), version, _cpu_flags()]).encode()).hexdigest()
    out = _cache_dir() / f"pdserve_kernels_{key[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], check=True, capture_output=True, text=True,
                       timeout=BUILD_TIMEOUT_S)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def cpu_kernels() -> CpuKernels | None:
    """The kernels; None with PDSERVE_CPU_KERNELS=0 (read on every call, so every caller
    honours it as set now) or where they cannot be had."""
    if os.environ.get(ENV_DISABLE, "1") == "0":
        return None
    return build_cpu_kernels()


@functools.cache
def build_cpu_kernels() -> CpuKernels | None:
    """The library, built and loaded on first use (cached per machine and per process)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.info("no C compiler: the fused CPU kernels are off (torch's ops run instead)")
        return None
    try:
        path = _build(compiler)
        torch.get_num_threads()  # torch (and its libgomp) loaded first: the library shares that pool
        lib = ctypes.CDLL(str(path))
        if lib.pdserve_abi_version() != ABI_VERSION:
            raise RuntimeError(f"{path}: ABI {lib.pdserve_abi_version()}, want {ABI_VERSION}")
        return CpuKernels(lib, path)
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
        detail = getattr(e, "stderr", "") or ""
        logger.warning("fused CPU kernels unavailable (%s%s); torch's ops run instead", e, f": {detail[-500:]}" if detail else "")
        return None
