"""Attention backends behind one interface, built by name.

Backends that need a GPU library import it only when built, so importing this
package works on any machine. "auto" is flashinfer on CUDA (when installed), torch elsewhere.
"""

from __future__ import annotations

import torch

from common.cache.kv_pool import KVPool
from common.model.attention.base import AttentionBackend, AttentionShape
from common.model.attention.flashinfer_support import resolve_attention_backend
from common.model.device_streams import DeviceStreams

ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")


def create_attention_backend(
    name: str, *, shape: AttentionShape, kv_pool: KVPool, req_to_token: torch.Tensor, streams: DeviceStreams | None = None
) -> AttentionBackend:
    name = resolve_attention_backend(name, shape, kv_pool.device, kv_pool.dtype)
    if name == "torch":
        from common.model.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(shape=shape, kv_pool=kv_pool, req_to_token=req_to_token, streams=streams)
    if name == "flashinfer":
        from common.model.attention.flashinfer_backend import FlashInferAttentionBackend

        return FlashInferAttentionBackend(shape=shape, kv_pool=kv_pool, req_to_token=req_to_token, streams=streams)
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(ATTENTION_BACKENDS)}")


__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionShape", "create_attention_backend"]
