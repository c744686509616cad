"""How many bytes the KV pool may take, measured AFTER the weights are loaded.

On CUDA, SGLang's rule: --mem-fraction-static of the GPU's TOTAL memory is for static
data (weights + KV pool); the rest (activations, sampling, library workspaces) stays free.
The weights are already on the GPU when this runs, so what they (and anything else on the
GPU, e.g. another instance) use is simply not free any more:

    total  |<------------- mem_fraction_static ------------->|<-- 1 - fraction -->|
           | weights (+ other users) |       KV pool         |  activations etc.  |
    kv = free_after_weights - total * (1 - mem_fraction_static)

Sizing from the free memory BEFORE loading (free x fraction) leaves no room for the weights:
any checkpoint over ~20% of the GPU ran out of memory at load.

On CPU the pool is --kv-cache-gb.
"""

from __future__ import annotations

import torch

GiB = float(1 << 30)


def gpu_kv_budget_bytes(device: torch.device, mem_fraction_static: float) -> int:
    torch.cuda.empty_cache()  # cached-but-unused blocks of the loader count as free
    free, total = torch.cuda.mem_get_info(device)
    kept_free = int(total * (1.0 - mem_fraction_static))
    budget = free - kept_free
    if budget <= 0:
        raise RuntimeError(
            f"no GPU memory left for the KV cache on {device}: {free / GiB:.2f} GiB free of "
            f"{total / GiB:.2f} GiB after loading the weights, and --mem-fraction-static "
            f"{mem_fraction_static} keeps {kept_free / GiB:.2f} GiB free for activations; raise "
            f"--mem-fraction-static, free the GPU, or use a GPU with more memory"
        )
    return budget


def kv_budget_bytes(device: torch.device, *, mem_fraction_static: float, kv_cache_gb: float) -> int:
    """Bytes for the KV pool on `device`; call it once the weights are on the device."""
    if device.type == "cuda":
        return gpu_kv_budget_bytes(device, mem_fraction_static)
    return int(kv_cache_gb * GiB)
