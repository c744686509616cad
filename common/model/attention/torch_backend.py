"""Paged attention in plain torch: gather K/V through req_to_token, then SDPA.

Runs on any device. Per step (init_forward_metadata) the requests are split:

    single-token requests (all of DECODE, the decode part of MIXED)
        -> sorted by length and cut into a few groups (decode_groups); per group one batched
           SDPA over K/V gathered to a padded [n, L] slot table + a length mask (the GQA group
           folds into the query axis: q [n, Hkv, G, D] vs k [n, Hkv, L, D]). One group padded
           to the longest sequence ran 2-2.5x slower on mixed lengths (bench/attention_cpu.py).
        on CPU with a bf16 pool and pdserve's C kernels (cpu_kernels): all of them in ONE call
        that reads each request's K/V pages in place through req_to_token (online softmax in
        fp32), no gather, no padding, no mask (_FusedDecode)
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
from common.model.cpu_kernels import CpuKernels, cpu_kernels
from common.model.device_streams import DeviceStreams
from common.model.forward_batch import ForwardBatch

# Per-group fixed cost (gather + SDPA call + index ops) in padded K/V rows it is worth.
GROUP_OVERHEAD_ROWS = 256
MAX_CUT_POINTS = 16
# A group's gathered K (and V) stays under ~1.5 MiB for a 3 x 64 bf16 head layout: SDPA over
# cache-sized pieces ran 1.1-1.5x faster than over one gather of 32-64 rows of equal length
# 500 (bench/attention_cpu.py, "uniform").
MAX_GROUP_KV_ROWS = 4096
# torch's CPU flash attention computes bf16/fp16 through oneDNN brgemm micro-kernels, one per
# (query rows, key rows) block shape, kept in a per-thread cache that never evicts
# (at::native::cpublas::Brgemm). Extends of every length built ~90 KiB of kernels per new shape
# in the model-worker thread for as long as the engine ran (the prefill soak's RSS slope,
# README). Padding each extend's queries and keys to a multiple of this bounds the shapes to a
# few dozen; the padding is masked out (keys) or dropped (query rows).
REDUCED_PRECISION_EXTEND_PAD = 64
MAX_FUSED_GROUP, MAX_FUSED_HEAD_DIM = 16, 256  # kernels.c: MAX_GROUP, MAX_HEAD_DIM


def extend_pad_rows(device: torch.device, dtype: torch.dtype) -> int:
    """Rows each extend's queries and keys are padded to a multiple of (1: not padded). fp32
    computes through plain GEMMs (no cached kernels) and keeps its exact, unpadded path."""
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        return REDUCED_PRECISION_EXTEND_PAD
    return 1


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def decode_groups(lengths: list[int]) -> list[list[int]]:
    """Split rows into groups that each pad to their own longest length, minimising
    sum(rows x longest) + GROUP_OVERHEAD_ROWS per group, then cut each group into pieces of at
    most MAX_GROUP_KV_ROWS padded K/V rows. Rows are sorted by length (longest first) and
    cut only at up to MAX_CUT_POINTS evenly spaced places, so the DP is tiny:

        sorted lengths   700 690 650 | 400 380 | 120 90 60 40
        padded cost      3 x 700     + 2 x 400 + 4 x 120       (+ 3 x overhead)
    """
    groups = []
    for group in _length_groups(lengths):
        rows = max(1, MAX_GROUP_KV_ROWS // max(lengths[r] for r in group))
        groups += [group[i : i + rows] for i in range(0, len(group), rows)]
    return groups


def _length_groups(lengths: list[int]) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda r: -lengths[r])
    n = len(order)
    if n <= 1:
        return [order]
    step = max(1, -(-n // MAX_CUT_POINTS))
    cuts = [*range(0, n, step), n]
    best = [0.0] + [float("inf")] * (len(cuts) - 1)
    prev = [0] * len(cuts)
    for j in range(1, len(cuts)):
        for i in range(j):
            cost = best[i] + (cuts[j] - cuts[i]) * lengths[order[cuts[i]]] + GROUP_OVERHEAD_ROWS
            if cost < best[j]:
                best[j], prev[j] = cost, i
    groups: list[list[int]] = []
    j = len(cuts) - 1
    while j > 0:
        groups.append(order[cuts[prev[j]] : cuts[j]])
        j = prev[j]
    return groups[::-1] if len(groups) > 1 else [list(range(n))]  # one group keeps the batch order


@dataclass
class _DecodeGroup:
    token_index: torch.Tensor | None  # [n] rows of the packed tokens; None = all tokens in order
    kv_blocks: torch.Tensor  # [n, P] int64 layer-0 K block of each page (page * 2L); padding: the reserved page 0
    mask: torch.Tensor  # [n, 1, 1, P * page_size] bool, True = attend


@dataclass
class _FusedDecode:
    """All single-token rows for decode_attention_bf16: int64 CPU tensors of n entries."""

    req: torch.Tensor  # req_to_token rows
    seq_len: torch.Tensor  # keys per row (this step's token included)
    token: torch.Tensor  # rows of the packed tokens


def _decode_kernels(kv_pool: KVPool, req_to_token: torch.Tensor, shape: AttentionShape) -> CpuKernels | None:
    """The C kernels where the fused decode attention takes this pool and head layout."""
    if kv_pool.device.type != "cpu" or kv_pool.dtype != torch.bfloat16 or req_to_token.dtype not in (torch.int32, torch.int64):
        return None
    if shape.group_size > MAX_FUSED_GROUP or shape.head_dim > MAX_FUSED_HEAD_DIM or not req_to_token.is_contiguous():
        return None
    return cpu_kernels()


@dataclass
class _ExtendSeq:
    start: int  # first row in the packed tokens
    length: int  # extend tokens
    padded_length: int  # query rows SDPA computes (extend_pad_rows); rows past `length` are dropped
    kv_rows: torch.Tensor  # [padded seq_len] int64 layer-0 K rows (KVPool.slot_base); padding repeats row 0
    mask: torch.Tensor | None  # [padded_length, padded seq_len] bool; None = plain causal (no prefix)


class TorchAttentionBackend(AttentionBackend):
    def __init__(
        self, *, shape: AttentionShape, kv_pool: KVPool, req_to_token: torch.Tensor, streams: DeviceStreams | None = None
    ) -> None:
        super().__init__(shape=shape, kv_pool=kv_pool, req_to_token=req_to_token, streams=streams)
        self._decode: list[_DecodeGroup] = []
        self._extends: list[_ExtendSeq] = []
        self._extend_pad = extend_pad_rows(kv_pool.device, kv_pool.dtype)
        self._kernels = _decode_kernels(kv_pool, req_to_token, shape)
        self._fused: _FusedDecode | None = None

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        device = batch.input_ids.device
        ext = batch.extend_lens_cpu
        single = [r for r, e in enumerate(ext) if e == 1]
        multi = [r for r, e in enumerate(ext) if e > 1]
        starts = [0] * len(ext)
        for r in range(1, len(ext)):
            starts[r] = starts[r - 1] + ext[r - 1]
        max_len = max(batch.seq_lens_cpu, default=0)
        table = (
            self.req_to_token[batch.req_pool_indices, :max_len].to(torch.int64)  # [bs, max_len]
            if multi or self._kernels is None else self.req_to_token[:0].to(torch.int64)
        )

        self._decode, self._fused = [], None
        if self._kernels is not None and single:
            req = batch.req_pool_indices if len(single) == len(ext) else batch.req_pool_indices[torch.tensor(single)]
            self._fused = _FusedDecode(
                req=req.to(torch.int64).contiguous(),
                seq_len=torch.tensor([batch.seq_lens_cpu[r] for r in single], dtype=torch.int64),
                token=torch.tensor([starts[r] for r in single], dtype=torch.int64),
            )
            single = []
        ps = self.kv_pool.page_size
        groups = [[single[i] for i in g] for g in decode_groups([batch.seq_lens_cpu[r] for r in single])] if single else []
        in_order = [rows_cpu == list(range(len(ext))) for rows_cpu in groups]
        # the row indices and token indices of every reordered group, staged in one copy
        staged = iter(self.streams.stage(
            [x for g, o in zip(groups, in_order, strict=True) if not o for x in (g, [starts[r] for r in g])],
            torch.int64,
        ))
        for rows_cpu, ordered in zip(groups, in_order, strict=True):
            length = max(batch.seq_lens_cpu[r] for r in rows_cpu)
            token_index: torch.Tensor | None = None
            if ordered:
                seq_lens, page_starts = batch.seq_lens, table[:, :length:ps]  # page_starts: [n, pages]
            else:
                rows, token_index = next(staged), next(staged)
                seq_lens, page_starts = batch.seq_lens[rows], table[rows, :length:ps]
            length = page_starts.shape[1] * ps  # padded to whole pages: gathered page by page
            valid = torch.arange(length, device=device)[None, :] < seq_lens[:, None]
            self._decode.append(
                _DecodeGroup(
                    token_index=token_index,
                    kv_blocks=page_starts.masked_fill(~valid[:, ::ps], 0) // ps * (2 * self.kv_pool.num_layers),
                    mask=valid[:, None, None, :],
                )
            )

        self._extends = []
        for r in multi:
            e, p, s = ext[r], batch.prefix_lens_cpu[r], batch.seq_lens_cpu[r]
            e_pad, s_pad = round_up(e, self._extend_pad), round_up(s, self._extend_pad)
            kv_rows = self.kv_pool.slot_base(table[r, :s])
            mask: torch.Tensor | None = None
            if p > 0:  # padded keys (j >= s) are masked out; padded query rows see the real ones
                j = torch.arange(s_pad, device=device)[None, :]
                mask = j <= p + torch.arange(e_pad, device=device)[:, None]
                if s_pad > s:
                    mask &= j < s
            else:  # square causal: padded keys are visible to padded query rows only
                s_pad = e_pad
            if s_pad > s:
                kv_rows = torch.cat([kv_rows, kv_rows[:1].expand(s_pad - s)])
            self._extends.append(
                _ExtendSeq(start=starts[r], length=e, padded_length=e_pad, kv_rows=kv_rows, mask=mask)
            )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        pool = self.kv_pool
        out = q.new_empty(num_tokens, num_heads * head_dim)
        if self._fused is not None:
            self._forward_fused_decode(q, layer_id, out, self._fused)
        for group in self._decode:
            self._forward_decode(q, layer_id, out, group)
        k_row, v_row = pool.layer_row(layer_id, 0), pool.layer_row(layer_id, 1)
        for seq in self._extends:
            rows = slice(seq.start, seq.start + seq.length)
            kk = self._gather(pool.rows, seq.kv_rows + k_row, q.dtype).transpose(0, 1)  # [Hkv, S, D]
            vv = self._gather(pool.rows, seq.kv_rows + v_row, q.dtype).transpose(0, 1)
            # 4-D ([1, H, e, D]): with 3-D inputs torch's CPU SDPA takes its math path, 3x
            # slower for a 512-token chunk over a 1.5k prefix (bench/attention_cpu.py).
            qs = q[rows]
            if seq.padded_length > seq.length:
                qs = torch.cat([qs, qs.new_zeros(seq.padded_length - seq.length, num_heads, head_dim)])
            o = F.scaled_dot_product_attention(
                qs.transpose(0, 1)[None],  # [1, H, e, D]
                kk[None],
                vv[None],
                attn_mask=seq.mask,
                is_causal=seq.mask is None,
                scale=self.shape.scaling,
                enable_gqa=True,
            )[0]
            out[rows] = o[:, : seq.length].transpose(0, 1).reshape(seq.length, num_heads * head_dim)
        return out

    def _forward_fused_decode(self, q: torch.Tensor, layer: int, out: torch.Tensor, f: _FusedDecode) -> None:
        assert self._kernels is not None
        if q.dtype != torch.bfloat16 or q.stride(2) != 1 or q.stride(1) != q.shape[2]:
            q = q.to(torch.bfloat16).contiguous()
        pool, rt, shape = self.kv_pool, self.req_to_token, self.shape
        self._kernels.calls += 1
        rc = self._kernels.decode_attention_bf16(
            q.data_ptr(), q.stride(0), out.data_ptr(), pool.kv.data_ptr(), rt.data_ptr(), rt.stride(0), int(rt.dtype == torch.int32),
            f.req.data_ptr(), f.seq_len.data_ptr(), f.token.data_ptr(), f.req.shape[0], shape.num_kv_heads,
            shape.group_size, shape.head_dim, pool.num_layers, pool.page_size, layer, shape.scaling,
            torch.get_num_threads(),
        )
        assert rc == 0, "decode_attention_bf16 refused the head layout"

    def _forward_decode(self, q: torch.Tensor, layer: int, out: torch.Tensor, g: _DecodeGroup) -> None:
        n, length = g.mask.shape[0], g.mask.shape[-1]
        hkv, d = self.shape.num_kv_heads, self.shape.head_dim
        pool, blocks = self.kv_pool, g.kv_blocks.reshape(-1)
        kk = self._gather(pool.blocks, blocks + pool.layer_block(layer, 0), q.dtype)  # one row copy per page
        vv = self._gather(pool.blocks, blocks + pool.layer_block(layer, 1), q.dtype)
        kk = kk.view(n, length, hkv, d).transpose(1, 2)  # [n, Hkv, L, D]
        vv = vv.view(n, length, hkv, d).transpose(1, 2)
        qq = q if g.token_index is None else q.index_select(0, g.token_index)
        qq = qq.view(n, hkv, self.shape.group_size, d)  # GQA group folded into the query axis
        o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=g.mask, scale=self.shape.scaling)
        o = o.reshape(n, hkv * self.shape.group_size * d)
        if g.token_index is None:
            out.copy_(o)
        else:
            out.index_copy_(0, g.token_index, o)

    def _gather(self, view: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `index` of a 2-D pool view (KVPool.rows: one token; KVPool.blocks: one page of one
        layer's K or V), in order, as [tokens, Hkv, D] in `dtype`. NOTE: index_select on a 2-D
        view is far faster on CPU than indexing a multi-dim buffer (a per-element path for bf16)."""
        rows = view.index_select(0, index)
        return rows.view(-1, self.kv_pool.num_kv_heads, self.kv_pool.head_dim).to(dtype)
