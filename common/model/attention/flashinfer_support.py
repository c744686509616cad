"""What the flashinfer backend can run, checked at startup rather than at the first request.

Facts read from flashinfer's source at the pinned release (pyproject's `cuda` extra):

- The CUDA-core batch decode kernel is compiled for GQA group sizes 1, 2, 3, 4 and 8 only
  (DISPATCH_GQA_GROUP_SIZE in include/flashinfer/utils.cuh); any other ratio raises
  "Unsupported group_size" at plan(). The tensor-core decode path reuses the prefill kernels,
  which take any ratio. SGLang's rule: tensor cores for fp16/bf16 when the group is >= 4.
- The attention kernels pdserve uses are built for float16/bfloat16 queries and KV.
- head_dim 64, 128, 256 (and 512 on recent GPUs) are the supported head sizes.

The module itself is imported only when the backend is built, and never on CPU unless a
stand-in that declares `PDSERVE_DEVICE_TYPES` (tests' CPU reference) replaces it.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

import torch

from common.model.attention.base import AttentionShape

logger = logging.getLogger(__name__)

FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
FLASHINFER_HEAD_DIMS = (64, 128, 256, 512)
CUDA_CORE_DECODE_GROUP_SIZES = (1, 2, 3, 4, 8)
TENSOR_CORE_MIN_GROUP_SIZE = 4


def decode_uses_tensor_cores(dtype: torch.dtype, group_size: int) -> bool:
    """SGLang's rule: fp16/bf16 KV with a GQA group of 4 or more goes to the tensor-core path."""
    return dtype in FLASHINFER_DTYPES and group_size >= TENSOR_CORE_MIN_GROUP_SIZE


def flashinfer_shape_problem(shape: AttentionShape, dtype: torch.dtype) -> str | None:
    """None when the flashinfer kernels run this model's attention, else why not."""
    if dtype not in FLASHINFER_DTYPES:
        name = str(dtype).removeprefix("torch.")
        return f"flashinfer runs float16/bfloat16 attention, not {name}; use --dtype bfloat16 or --attention-backend torch"
    if shape.head_dim not in FLASHINFER_HEAD_DIMS:
        return (
            f"flashinfer supports head_dim {', '.join(map(str, FLASHINFER_HEAD_DIMS))}, the model has "
            f"{shape.head_dim}; use --attention-backend torch"
        )
    group = shape.group_size
    if not decode_uses_tensor_cores(dtype, group) and group not in CUDA_CORE_DECODE_GROUP_SIZES:
        return (
            f"flashinfer's CUDA-core decode kernel supports GQA group sizes "
            f"{', '.join(map(str, CUDA_CORE_DECODE_GROUP_SIZES))}, the model has {group} "
            f"({shape.num_heads} heads / {shape.num_kv_heads} KV heads)"
        )
    return None


def load_flashinfer(device: torch.device) -> Any:
    """The flashinfer module, after checking it can run on `device`."""
    needs_cuda = f"the flashinfer attention backend needs a CUDA KV pool, got {device}"
    try:
        import flashinfer
    except ImportError as e:
        if device.type != "cuda":
            raise RuntimeError(needs_cuda) from e
        raise RuntimeError(
            "attention backend 'flashinfer' needs the flashinfer package: pip install -e '.[cuda]' "
            "(or pass --attention-backend torch)"
        ) from e
    if device.type not in getattr(flashinfer, "PDSERVE_DEVICE_TYPES", ("cuda",)):
        raise RuntimeError(needs_cuda)
    return flashinfer


def resolve_attention_backend(name: str, shape: AttentionShape, device: torch.device, dtype: torch.dtype) -> str:
    """ "auto" -> flashinfer on CUDA when it is installed and runs the model's attention (the
    torch backend's grouping is tuned for a CPU cache: ~2k attention calls per decode step at
    batch 64 on a GPU), torch otherwise (with a warning on CUDA, where that is slow)."""
    if name != "auto":
        return name
    if device.type != "cuda":
        return "torch"
    problem = flashinfer_shape_problem(shape, dtype)
    if problem is None and importlib.util.find_spec("flashinfer") is None:
        problem = "flashinfer is not installed (pip install -e '.[cuda]')"
    if problem is not None:
        logger.warning("attention on %s falls back to the slow torch backend: %s", device, problem)
        return "torch"
    return "flashinfer"
