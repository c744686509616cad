"""Attention test cases: a KV pool with random K/V on scattered pages, a batch over it, and a
float64 reference computed one request at a time.

    CASES: name -> (mode, [(prefix_len, extend_len) per request])
    token i of request r (extend part) attends to positions [0, prefix_r + i]
"""

from __future__ import annotations

import random

import torch

from common.cache.kv_pool import KVPool
from common.model.attention import AttentionShape
from common.model.forward_batch import ForwardBatch, ForwardMode

CASES = {
    "extend": (ForwardMode.EXTEND, [(0, 7), (5, 9), (0, 1), (16, 3)]),  # chunks on a prefix, one-token prompt
    "decode": (ForwardMode.DECODE, [(0, 1), (12, 1), (40, 1), (3, 1)]),
    "mixed": (ForwardMode.MIXED, [(10, 1), (0, 20), (33, 1), (2, 5)]),
    # decode rows of very different lengths: several length groups (torch backend's decode_groups)
    "decode_groups": (ForwardMode.DECODE, [(0, 1), (400, 1), (3, 1), (120, 1), (5, 1), (250, 1)]),
    "mixed_groups": (ForwardMode.MIXED, [(400, 1), (0, 20), (3, 1), (120, 1), (2, 5), (250, 1)]),
}


def gqa_shape(head_dim: int, group: int, num_kv_heads: int = 2) -> AttentionShape:
    return AttentionShape(
        num_heads=group * num_kv_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, scaling=head_dim**-0.5
    )


def make_case(
    shape: AttentionShape,
    mode: ForwardMode,
    prefix_and_extend: list[tuple[int, int]],
    page_size: int,
    device: str,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[KVPool, torch.Tensor, ForwardBatch, torch.Tensor]:
    """A pool with random K/V, scattered pages per request, and a batch over them; returns q too."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    pool = KVPool(
        num_layers=2, num_pages=64 + 1024 // page_size, page_size=page_size, num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim, dtype=dtype, device=device,
    )
    pool.kv.normal_()
    req_to_token = torch.zeros(8, 512, dtype=torch.int32, device=device)
    pages = list(range(1, pool.num_pages))
    rng.shuffle(pages)
    ids, positions, out_loc, rows, seq_lens, prefix_lens = [], [], [], [], [], []
    for r, (prefix, extend) in enumerate(prefix_and_extend):
        row = 7 - r
        seq = prefix + extend
        own = [pages.pop() for _ in range((seq + page_size - 1) // page_size)]
        slots = [own[i // page_size] * page_size + i % page_size for i in range(seq)]
        req_to_token[row, :seq] = torch.tensor(slots, dtype=torch.int32)
        ids += [1] * extend
        positions += list(range(prefix, seq))
        out_loc += slots[prefix:]
        rows.append(row)
        seq_lens.append(seq)
        prefix_lens.append(prefix)
    batch = ForwardBatch.build(mode, ids, positions, out_loc, rows, seq_lens, prefix_lens, device=device)
    q = torch.randn(len(ids), shape.num_heads, shape.head_dim, device=device, dtype=dtype)
    return pool, req_to_token, batch, q


def reference(
    shape: AttentionShape, pool: KVPool, req_to_token: torch.Tensor, batch: ForwardBatch, q: torch.Tensor, layer: int
) -> torch.Tensor:
    """float64 attention of every new token, [num_tokens, num_heads * head_dim]."""
    out = []
    start = 0
    for r in range(batch.batch_size):
        p, e, s = batch.prefix_lens_cpu[r], batch.extend_lens_cpu[r], batch.seq_lens_cpu[r]
        slots = req_to_token[batch.req_pool_indices[r], :s].long()
        page, off = slots // pool.page_size, slots % pool.page_size  # kv: [pages, layers, K/V, page_size, H, D]
        k = pool.kv[page, layer, 0, off].double().repeat_interleave(shape.group_size, dim=1)  # [s, H, D]
        v = pool.kv[page, layer, 1, off].double().repeat_interleave(shape.group_size, dim=1)
        qq = q[start : start + e].double()
        scores = torch.einsum("ehd,shd->hes", qq, k) * shape.scaling
        allowed = torch.arange(s)[None, :] <= (p + torch.arange(e))[:, None]
        scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
        out.append(torch.einsum("hes,shd->ehd", scores.softmax(-1), v).reshape(e, -1))
        start += e
    return torch.cat(out)
