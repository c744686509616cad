"""--base-gpu-id / cuda:N pick the instance's GPU; threads that launch kernels bind to it (CUDA faked)."""

from __future__ import annotations

import pytest
import torch

from common.model.device import on_device_thread, resolve_device
from common.server.server_args import ServerArgs, parse_server_args


def fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> list[torch.device]:
    current: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: current.append(torch.device(device)))
    return current


def test_base_gpu_id_picks_the_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, 4)
    assert resolve_device("cuda", 2) == torch.device("cuda", 2)
    assert resolve_device("auto", 3) == torch.device("cuda", 3)
    assert resolve_device("cuda:1", 3) == torch.device("cuda", 1)  # an explicit index wins
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cpu", 2) == torch.device("cpu")


def test_a_gpu_that_is_not_there_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(ValueError, match=r"GPU 2 requested \(--base-gpu-id\), but torch sees 2 GPU\(s\) \(CUDA_VISIBLE_DEVICES=0,1\)"):
        resolve_device("cuda", 2)


def test_auto_without_a_gpu_is_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, 0)
    assert resolve_device("auto", 5) == torch.device("cpu")


def test_worker_thread_hook_binds_the_gpu_then_runs_the_callback(monkeypatch: pytest.MonkeyPatch) -> None:
    current = fake_gpus(monkeypatch, 4)
    calls: list[str] = []
    on_device_thread(torch.device("cuda", 3), lambda: calls.append(f"then, on {current[-1]}"))()
    assert current == [torch.device("cuda", 3)] and calls == ["then, on cuda:3"]
    on_device_thread(torch.device("cpu"))()
    assert current == [torch.device("cuda", 3)]  # nothing to bind on CPU


def test_base_gpu_id_flag() -> None:
    assert parse_server_args(["--base-gpu-id", "3"]).base_gpu_id == 3
    assert ServerArgs().base_gpu_id == 0
    with pytest.raises(ValueError, match="--base-gpu-id must be >= 0"):
        ServerArgs(base_gpu_id=-1)
