"""FlashInfer paged attention (CUDA only; flashinfer is imported when the backend is built).

The KV pool's per-layer buffers [num_pages * page_size, Hkv, D] are viewed as
FlashInfer's NHD paged cache [num_pages, page_size, Hkv, D]. A request's page
table is read from req_to_token at every page_size-th token:

    req_to_token[row]:  s0 s0+1 .. | s1 s1+1 .. | s2 ..      (slots, page-aligned runs)
    pages:              s0 // P      s1 // P      s2 // P
    last_page_len = seq_len - (num_pages - 1) * P

DECODE batches use the decode wrapper; EXTEND/MIXED use the paged prefill wrapper,
whose causal mask is aligned to the end of each sequence (full over the prefix).
"""

from __future__ import annotations

from typing import Any

import torch

from common.cache.kv_pool import KVPool
from common.model.attention.base import AttentionBackend, AttentionShape
from common.model.forward_batch import ForwardBatch, ForwardMode

WORKSPACE_BYTES = 128 * 1024 * 1024


class FlashInferAttentionBackend(AttentionBackend):
    def __init__(self, *, shape: AttentionShape, kv_pool: KVPool, req_to_token: torch.Tensor) -> None:
        super().__init__(shape=shape, kv_pool=kv_pool, req_to_token=req_to_token)
        if kv_pool.device.type != "cuda":
            raise RuntimeError(f"the flashinfer attention backend needs a CUDA KV pool, got {kv_pool.device}")
        try:
            import flashinfer
        except ImportError as e:
            raise RuntimeError("attention backend 'flashinfer' needs the flashinfer package") from e
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=kv_pool.device)
        self._decode: Any = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        self._prefill: Any = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        self._use_decode = False
        page, hkv, d = kv_pool.page_size, kv_pool.num_kv_heads, kv_pool.head_dim
        self._caches = [
            (k.view(-1, page, hkv, d), v.view(-1, page, hkv, d))
            for k, v in zip(kv_pool.k_buffers, kv_pool.v_buffers, strict=True)
        ]

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        device = self.kv_pool.device
        page = self.kv_pool.page_size
        num_pages = [(s + page - 1) // page for s in batch.seq_lens_cpu]
        max_pages = max(num_pages, default=0)
        table = self.req_to_token[batch.req_pool_indices, : max_pages * page : page] // page
        valid = torch.arange(max_pages, device=device)[None, :] < torch.tensor(num_pages, device=device)[:, None]
        indices = table[valid].to(torch.int32)
        indptr = _cumsum0(num_pages, device)
        last = torch.tensor(
            [s - (n - 1) * page for s, n in zip(batch.seq_lens_cpu, num_pages, strict=True)],
            dtype=torch.int32,
            device=device,
        )
        common = dict(
            num_qo_heads=self.shape.num_heads,
            num_kv_heads=self.shape.num_kv_heads,
            page_size=page,
            sm_scale=self.shape.scaling,
            q_data_type=self.kv_pool.dtype,
            kv_data_type=self.kv_pool.dtype,
        )
        self._use_decode = batch.mode == ForwardMode.DECODE
        if self._use_decode:
            self._decode.plan(indptr, indices, last, head_dim=self.shape.head_dim, **common)
        else:
            qo_indptr = _cumsum0(batch.extend_lens_cpu, device)
            self._prefill.plan(
                qo_indptr, indptr, indices, last, head_dim_qk=self.shape.head_dim, causal=True, **common
            )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        wrapper = self._decode if self._use_decode else self._prefill
        o = wrapper.run(q.to(self.kv_pool.dtype).contiguous(), self._caches[layer_id])
        return o.to(q.dtype).reshape(q.shape[0], -1)


def _cumsum0(lengths: list[int], device: torch.device) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)
