"""Which device an instance runs on: `--device` plus `--base-gpu-id` (SGLang's name) -> cuda:N.

Every instance on a host sees all of the host's GPUs (CUDA_VISIBLE_DEVICES untouched, so
UCX can use cuda_ipc between a prefill and a decode GPU) and picks its own by index;
launch/pd.sh --gpus-per-host gives each instance on a host its own index.

The CUDA "current device" is per thread: set it in every thread that launches kernels
(the overlap loop's worker thread too), or work without an explicit device (streams,
library workspaces) lands on cuda:0.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch


def resolve_device(name: str, base_gpu_id: int = 0) -> torch.device:
    """ "auto" -> cuda when torch sees a GPU, else cpu; cuda -> cuda:<base_gpu_id>; an explicit
    cuda:N wins over base_gpu_id."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type != "cuda":
        return device
    index = base_gpu_id if device.index is None else device.index
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
        raise ValueError(
            f"GPU {index} requested (--base-gpu-id), but torch sees {count} GPU(s) "
            f"(CUDA_VISIBLE_DEVICES={visible})"
        )
    return torch.device("cuda", index)


def use_device(device: torch.device) -> None:
    """Make `device` the calling thread's current CUDA device (no-op elsewhere)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def on_device_thread(device: torch.device, then: Callable[[], None] | None = None) -> Callable[[], None]:
    """A thread-start hook: use_device(device), then `then` (if any)."""

    def start() -> None:
        use_device(device)
        if then is not None:
            then()

    return start
