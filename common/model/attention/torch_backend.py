"""Paged attention in plain torch: gather K/V through req_to_token, then SDPA.

Runs on any device. Per step (init_forward_metadata) the requests are split:

    single-token requests (all of DECODE, the decode part of MIXED)
        -> one batched SDPA over K/V gathered to a padded [n, L] slot table + a length mask
           (the GQA group folds into the query axis: q [n, Hkv, G, D] vs k [n, Hkv, L, D])
    multi-token requests (EXTEND chunks)
        -> one SDPA per request over its whole sequence, causal w.r.t. its extend part:

           kv position j:  0 ............ prefix_len ........... seq_len
           query i (0..e):  allowed iff j <= prefix_len + i
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.cache.kv_pool import KVPool
from common.model.attention.base import AttentionBackend, AttentionShape
from common.model.forward_batch import ForwardBatch


@dataclass
class _DecodeGroup:
    token_index: torch.Tensor | None  # [n] rows of the packed tokens; None = all tokens in order
    kv_index: torch.Tensor  # [n, L] int64 slots, padding points at the reserved slot 0
    mask: torch.Tensor  # [n, 1, 1, L] bool, True = attend


@dataclass
class _ExtendSeq:
    start: int  # first row in the packed tokens
    length: int  # extend tokens
    kv_index: torch.Tensor  # [seq_len] int64 slots of the whole sequence
    mask: torch.Tensor | None  # [length, seq_len] bool; None = plain causal (no prefix)


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, *, shape: AttentionShape, kv_pool: KVPool, req_to_token: torch.Tensor) -> None:
        super().__init__(shape=shape, kv_pool=kv_pool, req_to_token=req_to_token)
        self._decode: _DecodeGroup | None = None
        self._extends: list[_ExtendSeq] = []

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        device = batch.input_ids.device
        ext = batch.extend_lens_cpu
        single = [r for r, e in enumerate(ext) if e == 1]
        multi = [r for r, e in enumerate(ext) if e > 1]
        starts = [0] * len(ext)
        for r in range(1, len(ext)):
            starts[r] = starts[r - 1] + ext[r - 1]
        max_len = max(batch.seq_lens_cpu, default=0)
        table = self.req_to_token[batch.req_pool_indices, :max_len].to(torch.int64)  # [bs, max_len]

        self._decode = None
        if single:
            all_single = len(single) == len(ext)
            rows = torch.tensor(single, dtype=torch.int64, device=device)
            seq_lens = batch.seq_lens if all_single else batch.seq_lens[rows]
            length = max(batch.seq_lens_cpu[r] for r in single)
            kv_index = table[:, :length] if all_single else table[rows, :length]
            valid = torch.arange(length, device=device)[None, :] < seq_lens[:, None]
            self._decode = _DecodeGroup(
                token_index=None if all_single else torch.tensor([starts[r] for r in single], device=device),
                kv_index=kv_index.masked_fill(~valid, 0),
                mask=valid[:, None, None, :],
            )

        self._extends = []
        for r in multi:
            e, p, s = ext[r], batch.prefix_lens_cpu[r], batch.seq_lens_cpu[r]
            mask: torch.Tensor | None = None
            if p > 0:
                mask = torch.arange(s, device=device)[None, :] <= (p + torch.arange(e, device=device))[:, None]
            self._extends.append(_ExtendSeq(start=starts[r], length=e, kv_index=table[r, :s], mask=mask))

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        k_buf = self.kv_pool.k_buffers[layer_id]
        v_buf = self.kv_pool.v_buffers[layer_id]
        out = q.new_empty(num_tokens, num_heads * head_dim)
        if self._decode is not None:
            self._forward_decode(q, k_buf, v_buf, out, self._decode)
        for seq in self._extends:
            rows = slice(seq.start, seq.start + seq.length)
            kk = _gather(k_buf, seq.kv_index, q.dtype).transpose(0, 1)  # [Hkv, S, D]
            vv = _gather(v_buf, seq.kv_index, q.dtype).transpose(0, 1)
            # 4-D ([1, H, e, D]): with 3-D inputs torch's CPU SDPA takes its math path, 3x
            # slower for a 512-token chunk over a 1.5k prefix (bench/attention_cpu.py).
            o = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1)[None],  # [1, H, e, D]
                kk[None],
                vv[None],
                attn_mask=seq.mask,
                is_causal=seq.mask is None,
                scale=self.shape.scaling,
                enable_gqa=True,
            )[0]
            out[rows] = o.transpose(0, 1).reshape(seq.length, num_heads * head_dim)
        return out

    def _forward_decode(
        self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, out: torch.Tensor, g: _DecodeGroup
    ) -> None:
        n, length = g.kv_index.shape
        hkv, d = self.shape.num_kv_heads, self.shape.head_dim
        flat = g.kv_index.reshape(-1)
        kk = _gather(k_buf, flat, q.dtype).view(n, length, hkv, d).transpose(1, 2)  # [n, Hkv, L, D]
        vv = _gather(v_buf, flat, q.dtype).view(n, length, hkv, d).transpose(1, 2)
        qq = q if g.token_index is None else q.index_select(0, g.token_index)
        qq = qq.view(n, hkv, self.shape.group_size, d)  # GQA group folded into the query axis
        o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=g.mask, scale=self.shape.scaling)
        o = o.reshape(n, hkv * self.shape.group_size * d)
        if g.token_index is None:
            out.copy_(o)
        else:
            out.index_copy_(0, g.token_index, o)


def _gather(buf: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """buf[slots] as [n, Hkv, D] in `dtype`. NOTE: index_select on the 2-D [slots, Hkv*D] view is
    far faster on CPU than on the 3-D buffer (a per-element path, very slow for bf16)."""
    rows = buf.view(buf.shape[0], -1).index_select(0, slots)
    return rows.view(-1, *buf.shape[1:]).to(dtype)
