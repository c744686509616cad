"""The attention backend interface.

Who owns what: the model runner owns one backend for its lifetime. The backend
reads K/V from the KVPool through the scheduler's req_to_token table (both
owned elsewhere and only read here). Per step the runner calls
`init_forward_metadata(batch)` once; then every attention layer first writes
its new K/V into the pool at `batch.out_cache_loc` and calls `forward`, which
must do as little per-layer work as possible (all index building happens in
init_forward_metadata).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from common.cache.kv_pool import KVPool
from common.model.device_streams import DeviceStreams, HostStreams
from common.model.forward_batch import ForwardBatch


@dataclass(frozen=True)
class AttentionShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float  # softmax scale, usually head_dim ** -0.5

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


class AttentionBackend(ABC):
    def __init__(
        self, *, shape: AttentionShape, kv_pool: KVPool, req_to_token: torch.Tensor, streams: DeviceStreams | None = None
    ) -> None:
        """streams: how index tensors built on the host reach the device (never a blocking copy)."""
        if shape.num_heads % shape.num_kv_heads:
            raise ValueError(f"num_heads {shape.num_heads} is not a multiple of num_kv_heads {shape.num_kv_heads}")
        if req_to_token.dim() != 2:
            raise ValueError(f"req_to_token must be [max_reqs, max_context_len], got {tuple(req_to_token.shape)}")
        self.shape = shape
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.streams = streams or HostStreams(kv_pool.device)
        self.decode_bucket: int | None = None  # set while a bucketed decode step runs

    # True when init_forward_metadata leaves everything forward() reads in fixed device buffers,
    # so a decode step can be captured in a CUDA graph (decode_graphs.py).
    graph_capturable = False

    def prepare_decode_buckets(self, sizes: list[int]) -> None:
        """Allocate whatever a decode step padded to each of `sizes` rows needs at fixed addresses."""
        self.decode_bucket = None

    def use_decode_bucket(self, size: int | None) -> None:
        """The next decode steps are padded to `size` rows (None: not bucketed)."""
        self.decode_bucket = size

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Build the index tensors of this step (called once per step, before the first layer)."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        """Attention of this step's tokens over their whole sequences.

        q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim] are the
        new tokens' keys/values, ALREADY written to the pool at batch.out_cache_loc.
        Returns [num_tokens, num_heads * head_dim] in q's dtype. Token i of request r attends to
        positions [0, prefix_len_r + i] of its sequence (causal over the extend part, full over
        the cached prefix).
        """
