"""FlashInfer paged attention (CUDA; flashinfer is imported when the backend is built).

Each layer reads the page-major pool in place: kv_pool.layer_cache(layer) is FlashInfer's
single-tensor NHD paged cache [num_pages, 2, page_size, Hkv, D], strided in its page dimension
(flashinfer unbinds K and V, whose strides are equal, and takes the page stride from the
tensor: common/cache/kv_pool.py). A request's page
table is read from req_to_token at every page_size-th token:

    req_to_token[row]:  s0 s0+1 .. | s1 s1+1 .. | s2 ..      (slots, page-aligned runs)
    pages:              s0 // P      s1 // P      s2 // P
    last_page_len = seq_len - (num_pages - 1) * P            (1 .. P)

DECODE batches use the decode wrapper (tensor cores for GQA groups >= 4: the CUDA-core
kernel only exists for a few group sizes); EXTEND/MIXED use the paged prefill wrapper,
whose causal mask is aligned to the end of each sequence (full over the prefix). Decode
steps captured in CUDA graphs (decode_graphs.py) use a decode wrapper per batch-size bucket
in use_cuda_graph=True mode, planned before each replay.

plan() gets the indptr / last-page arrays as pinned host tensors (flashinfer copies device
ones back to the host, a sync per step, and copies pageable ones to the device blocking) and
the page indices as a device tensor gathered without a boolean mask (which would sync too;
launch/gpu_check.sh and tests/model/test_host_syncs.py count syncs). Both
wrappers are planned and run once at construction on the reserved page 0, so the JIT
compile of every kernel happens at startup, not on the first request.

A wrapper's plan() writes its plan into the wrapper's one pinned host buffer and queues a copy
of it to the device. In the one-thread overlap loop step N+1 is planned while step N is still
queued, so before a wrapper plans again it waits for the event recorded after its previous
plan (that copy): by then the loop has collected step N-1, so the copy, queued right behind
it, is done or about to be, and the wait costs nothing, but it can never read N+1's plan.
"""

from __future__ import annotations

from typing import Any

import torch

from common.cache.kv_pool import KVPool
from common.model.attention.base import AttentionBackend, AttentionShape
from common.model.attention.flashinfer_support import (
    decode_uses_tensor_cores,
    flashinfer_shape_problem,
    load_flashinfer,
)
from common.model.device_streams import DeviceStreams, StepEvent
from common.model.forward_batch import ForwardBatch, ForwardMode

WORKSPACE_BYTES = 128 * 1024 * 1024


class FlashInferAttentionBackend(AttentionBackend):
    def __init__(
        self, *, shape: AttentionShape, kv_pool: KVPool, req_to_token: torch.Tensor, streams: DeviceStreams | None = None
    ) -> None:
        super().__init__(shape=shape, kv_pool=kv_pool, req_to_token=req_to_token, streams=streams)
        flashinfer = load_flashinfer(kv_pool.device)
        problem = flashinfer_shape_problem(shape, kv_pool.dtype)
        if problem is not None:
            raise ValueError(problem)
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=kv_pool.device)
        self.decode_tensor_cores = decode_uses_tensor_cores(kv_pool.dtype, shape.group_size)
        self._decode: Any = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_tensor_cores=self.decode_tensor_cores
        )
        self._prefill: Any = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        self._workspace = workspace
        self._graph_decode: dict[int, Any] = {}  # bucket size -> use_cuda_graph=True decode wrapper
        self._use_decode = False
        self._planned: dict[int, StepEvent] = {}  # id(wrapper) -> after its last plan's host -> device copy
        self._caches = [kv_pool.layer_cache(layer) for layer in range(kv_pool.num_layers)]
        self._warm_up()

    graph_capturable = True

    def prepare_decode_buckets(self, sizes: list[int]) -> None:
        """One decode wrapper per bucket in CUDA-graph mode: its indptr / page indices /
        last-page buffers sit at fixed addresses, refilled by plan() before each replay."""
        super().prepare_decode_buckets(sizes)
        flashinfer = load_flashinfer(self.kv_pool.device)
        device = self.kv_pool.device
        max_pages = self.req_to_token.shape[1] // self.kv_pool.page_size + 1
        for size in sizes:
            self._graph_decode[size] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.decode_tensor_cores,
                paged_kv_indptr_buffer=torch.zeros(size + 1, dtype=torch.int32, device=device),
                paged_kv_indices_buffer=torch.zeros(size * max_pages, dtype=torch.int32, device=device),
                paged_kv_last_page_len_buffer=torch.zeros(size, dtype=torch.int32, device=device),
            )

    def _decode_wrapper(self) -> Any:
        return self._decode if self.decode_bucket is None else self._graph_decode[self.decode_bucket]

    def _warm_up(self) -> None:
        """One decode and one prefill call over the reserved page 0 (never handed to a request)."""
        device = self.kv_pool.device
        one_page = torch.zeros(1, dtype=torch.int32, device=device)
        indptr = torch.tensor([0, 1], dtype=torch.int32)
        last = torch.ones(1, dtype=torch.int32)
        q = torch.zeros(1, self.shape.num_heads, self.shape.head_dim, dtype=self.kv_pool.dtype, device=device)
        self._plan(ForwardMode.DECODE, indptr, one_page, last, qo_indptr=indptr)
        self._decode.run(q, self._caches[0])
        self._plan(ForwardMode.EXTEND, indptr, one_page, last, qo_indptr=indptr)
        self._prefill.run(q, self._caches[0])

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        device = self.kv_pool.device
        page = self.kv_pool.page_size
        num_pages = [(s + page - 1) // page for s in batch.seq_lens_cpu]
        total = sum(num_pages)
        indptr = _cumsum0(num_pages)
        last = [s - (n - 1) * page for s, n in zip(batch.seq_lens_cpu, num_pages, strict=True)]
        # Page k of request r is req_to_token[row_r, k * page] // page, gathered in request order
        # (staged host -> device copies and output_size given: nothing here syncs).
        pages_per_req, first_page = self.streams.stage([num_pages, indptr[:-1]], torch.int64)
        rows = batch.req_pool_indices.repeat_interleave(pages_per_req, output_size=total)
        first = first_page.repeat_interleave(pages_per_req, output_size=total)
        cols = (torch.arange(total, device=device) - first) * page
        indices = (self.req_to_token[rows, cols] // page).to(torch.int32)
        host = self.streams.host
        self._plan(
            batch.mode, host(indptr, torch.int32), indices, host(last, torch.int32),
            qo_indptr=host(_cumsum0(batch.extend_lens_cpu), torch.int32),
        )

    def _plan(
        self, mode: ForwardMode, indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor, *, qo_indptr: torch.Tensor
    ) -> None:
        common = dict(
            num_qo_heads=self.shape.num_heads,
            num_kv_heads=self.shape.num_kv_heads,
            page_size=self.kv_pool.page_size,
            sm_scale=self.shape.scaling,
            q_data_type=self.kv_pool.dtype,
            kv_data_type=self.kv_pool.dtype,
        )
        self._use_decode = mode == ForwardMode.DECODE
        wrapper = self._decode_wrapper() if self._use_decode else self._prefill
        previous = self._planned.get(id(wrapper))
        if previous is not None:
            previous.synchronize()  # its pinned plan buffer is about to be rewritten
        if self._use_decode:
            wrapper.plan(indptr, indices, last, head_dim=self.shape.head_dim, **common)
        else:
            wrapper.plan(qo_indptr, indptr, indices, last, head_dim_qk=self.shape.head_dim, causal=True, **common)
        self._planned[id(wrapper)] = self.streams.record()

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        wrapper = self._decode_wrapper() if self._use_decode else self._prefill
        o = wrapper.run(q.to(self.kv_pool.dtype).contiguous(), self._caches[layer_id])
        return o.to(q.dtype).reshape(q.shape[0], -1)


def _cumsum0(lengths: list[int]) -> list[int]:
    """[0, l0, l0 + l1, ...]"""
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out
