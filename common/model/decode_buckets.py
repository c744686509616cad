"""Decode batches padded to a fixed set of batch sizes, so each size runs one captured step.

A CUDA graph (or an inductor-compiled decode step on CPU) is specialised to its tensors'
shapes and addresses. Decode batches of any size up to `max_bs` are therefore padded to the
next bucket and run through static input buffers:

    buckets (max_bs 64)   1 2 4 8 16 24 32 40 48 56 64      (SGLang's capture sizes)
    batch of 5 rows   ->  bucket 8: rows 0-4 real, rows 5-7 padding

    padding row: input id 0, position 0, KV written to slot 0 (the reserved scratch page,
                 never handed to a request), req_to_token row 0, seq_len 1
                 (it reads one slot and writes only the scratch page; its logits are dropped)

DecodeInputs owns the static buffers ([max_bs] each, on the device); load() copies a batch's
rows in (device -> device, async) and returns the padded ForwardBatch over the first `size`
rows. Shared by the CUDA graph runner and the CPU compiled decode step.
"""

from __future__ import annotations

import bisect

import torch

from common.model.forward_batch import ForwardBatch, ForwardMode

PAD_SLOT = 0  # first slot of the reserved page 0
PAD_ROW = 0
PAD_SEQ_LEN = 1


def capture_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_bs (max_bs itself included)."""
    if max_bs < 1:
        raise ValueError(f"max batch size must be >= 1, got {max_bs}")
    sizes = [s for s in (1, 2, 4, 8, *range(16, max_bs + 1, 8)) if s <= max_bs]
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


class DecodeBuckets:
    def __init__(self, max_bs: int) -> None:
        self.sizes = capture_batch_sizes(max_bs)
        self.max_bs = self.sizes[-1]

    def bucket_for(self, batch_size: int) -> int | None:
        """The smallest bucket that holds batch_size rows, None above max_bs."""
        if not 1 <= batch_size <= self.max_bs:
            return None
        return self.sizes[bisect.bisect_left(self.sizes, batch_size)]


class DecodeInputs:
    """Static [max_bs] input buffers of the captured decode steps."""

    def __init__(self, max_bs: int, device: torch.device) -> None:
        def buf(fill: int) -> torch.Tensor:
            return torch.full((max_bs,), fill, dtype=torch.int64, device=device)

        self.max_bs = max_bs
        self.input_ids = buf(0)
        self.positions = buf(0)
        self.out_cache_loc = buf(PAD_SLOT)
        self.req_pool_indices = buf(PAD_ROW)
        self.seq_lens = buf(PAD_SEQ_LEN)
        self.prefix_lens = buf(PAD_SEQ_LEN - 1)
        self.extend_lens = buf(1)

    def _fields(self, batch: ForwardBatch | None) -> list[tuple[torch.Tensor, torch.Tensor | None, int]]:
        """(buffer, the batch's tensor, padding value) of every per-row input."""
        return [
            (self.input_ids, None if batch is None else batch.input_ids, 0),
            (self.positions, None if batch is None else batch.positions, 0),
            (self.out_cache_loc, None if batch is None else batch.out_cache_loc, PAD_SLOT),
            (self.req_pool_indices, None if batch is None else batch.req_pool_indices, PAD_ROW),
            (self.seq_lens, None if batch is None else batch.seq_lens, PAD_SEQ_LEN),
            (self.prefix_lens, None if batch is None else batch.prefix_lens, PAD_SEQ_LEN - 1),
        ]

    def load(self, batch: ForwardBatch, size: int) -> ForwardBatch:
        """`batch` (DECODE, <= size rows) copied into the buffers, padded to `size` rows."""
        bs = batch.batch_size
        if batch.mode is not ForwardMode.DECODE or not 0 < bs <= size <= self.max_bs:
            raise ValueError(f"cannot pad a {batch.mode.value} batch of {bs} rows to {size} (max {self.max_bs})")
        for buf, src, fill in self._fields(batch):
            assert src is not None
            buf[:bs].copy_(src, non_blocking=True)
            buf[bs:size].fill_(fill)
        return self._batch(size, batch.seq_lens_cpu, batch.prefix_lens_cpu)

    def padding(self, size: int) -> ForwardBatch:
        """A batch of `size` padding rows (what a step is captured on)."""
        for buf, _, fill in self._fields(None):
            buf[:size].fill_(fill)
        return self._batch(size, [], [])

    def _batch(self, size: int, seq_lens: list[int], prefix_lens: list[int]) -> ForwardBatch:
        pad = size - len(seq_lens)
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            out_cache_loc=self.out_cache_loc[:size],
            req_pool_indices=self.req_pool_indices[:size],
            seq_lens=self.seq_lens[:size],
            prefix_lens=self.prefix_lens[:size],
            extend_lens=self.extend_lens[:size],
            seq_lens_cpu=seq_lens + [PAD_SEQ_LEN] * pad,
            prefix_lens_cpu=prefix_lens + [PAD_SEQ_LEN - 1] * pad,
            extend_lens_cpu=[1] * size,
        )
