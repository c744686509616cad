"""KV pool sizing on a GPU happens after the weights are loaded (torch.cuda memory calls faked)."""

from __future__ import annotations

import pytest
import torch

import common.model.model_runner as model_runner_module
from common.engine_core import build_engine_core, kv_budget_tokens
from common.model.config import ModelConfig
from common.model.model_runner import ModelRunner
from common.server.server_args import ServerArgs

GiB = 1 << 30
CUDA0 = torch.device("cuda", 0)


def fake_gpu(monkeypatch: pytest.MonkeyPatch, *, free: int, total: int) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)


def test_kv_gets_the_static_share_minus_what_the_weights_took(monkeypatch: pytest.MonkeyPatch, tiny_llama_path: str) -> None:
    # 80 GiB GPU, a 40 GiB checkpoint already loaded: static share 0.8 x 80 = 64 GiB, of which the
    # weights hold 40, so 24 GiB of KV; 16 GiB stay free for activations. (Free x fraction
    # before loading gave 64 GiB of KV: the weights then did not fit.)
    fake_gpu(monkeypatch, free=40 * GiB, total=80 * GiB)
    config = ModelConfig.from_pretrained(tiny_llama_path)
    per_token = ModelRunner.kv_bytes_per_token(config, torch.bfloat16, "cuda")
    tokens = kv_budget_tokens(ServerArgs(mem_fraction_static=0.8), config, torch.bfloat16, CUDA0)
    assert tokens == 24 * GiB // per_token


def test_no_room_left_after_the_weights_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tiny_llama_path: str) -> None:
    fake_gpu(monkeypatch, free=10 * GiB, total=80 * GiB)  # weights took 70 of 80 GiB; 0.8 keeps 16 free
    config = ModelConfig.from_pretrained(tiny_llama_path)
    with pytest.raises(RuntimeError, match="no GPU memory left for the KV cache.*raise --mem-fraction-static"):
        kv_budget_tokens(ServerArgs(mem_fraction_static=0.8), config, torch.bfloat16, CUDA0)


def test_engine_sizes_the_pool_after_loading_the_weights(monkeypatch: pytest.MonkeyPatch, tiny_llama_path: str) -> None:
    events: list[str] = []
    real_build_model, real_create_pool = model_runner_module.build_model, ModelRunner.create_kv_pool

    def build_model(*args, **kwargs):
        events.append("weights")
        return real_build_model(*args, **kwargs)

    def create_kv_pool(*args, **kwargs):
        events.append("kv pool")
        return real_create_pool(*args, **kwargs)

    monkeypatch.setattr(model_runner_module, "build_model", build_model)
    monkeypatch.setattr(ModelRunner, "create_kv_pool", staticmethod(create_kv_pool))
    args = ServerArgs(model_path=tiny_llama_path, device="cpu", dtype="float32", max_total_tokens=256, page_size=4,
                      chunked_prefill_size=64)
    core = build_engine_core(args, lambda _items: None)
    try:
        assert events == ["weights", "kv pool"]
        assert core.kv_pool is core.runner.kv_pool and core.runner.attn_backend.kv_pool is core.kv_pool
    finally:
        core.shutdown()

