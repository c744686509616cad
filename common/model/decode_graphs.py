"""Decode steps of up to max_bs rows through one captured step per batch-size bucket.

    startup:  for each bucket (largest first): an all-padding batch in the static buffers,
              attention metadata for it, then capture(size, step) -> replay
    a step:   decode batch of bs rows -> bucket size -> DecodeInputs.load (rows copied in,
              padded) -> attention metadata of the padded batch -> replay() -> logits[:bs]

`StepCapture` is what makes a step fast: CudaGraphCapture (cuda_graphs.py) records the
step's kernels once and replays them with one launch; EagerCapture reruns the step as it
is (CPU tests; an inductor-compiled step per bucket plugs in the same way). Attention
backends that plan per step outside the captured kernels (flashinfer, `graph_capturable`)
get a wrapper per bucket with fixed index buffers, replanned before every replay.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import torch

from common.cache.kv_pool import KVPool
from common.model.attention.base import AttentionBackend
from common.model.decode_buckets import DecodeBuckets, DecodeInputs
from common.model.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)

Step = Callable[[], torch.Tensor]


class StepCapture(Protocol):
    def capture(self, size: int, step: Step) -> Step:
        """A callable that reruns `step` on what its static inputs hold now; same output tensor."""
        ...


class EagerCapture:
    """Runs the step as it is (CPU): the padding and bucketing, without a graph."""

    def capture(self, size: int, step: Step) -> Step:
        return step


class SomeBuckets(EagerCapture):
    """`inner` captures only the buckets in `sizes`; the others run eagerly (a bench or a test
    compiles the batch sizes it measures, not every bucket)."""

    def __init__(self, inner: StepCapture, sizes: set[int]) -> None:
        self.inner, self.sizes = inner, sizes

    def capture(self, size: int, step: Step) -> Step:
        return self.inner.capture(size, step) if size in self.sizes else step


class DecodeModel(Protocol):
    def __call__(self, batch: ForwardBatch, kv_pool: KVPool, backend: AttentionBackend) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class DecodeGraphRunner:
    def __init__(
        self, model: DecodeModel, kv_pool: KVPool, backend: AttentionBackend, *, max_bs: int, capture: StepCapture
    ) -> None:
        self.buckets = DecodeBuckets(max_bs)
        self.inputs = DecodeInputs(self.buckets.max_bs, kv_pool.device)
        self.backend = backend
        backend.prepare_decode_buckets(self.buckets.sizes)
        self._steps: dict[int, Step] = {}
        start = time.perf_counter()
        for size in reversed(self.buckets.sizes):  # largest first: smaller graphs reuse its memory
            padding = self.inputs.padding(size)
            self._metadata(padding, size)

            def step(batch: ForwardBatch = padding) -> torch.Tensor:
                return model.compute_logits(model(batch, kv_pool, backend))

            self._steps[size] = capture.capture(size, step)
        backend.use_decode_bucket(None)
        logger.info("decode steps captured for batch sizes %s in %.1f s", self.buckets.sizes, time.perf_counter() - start)

    def _metadata(self, batch: ForwardBatch, size: int) -> None:
        self.backend.use_decode_bucket(size)
        self.backend.init_forward_metadata(batch)

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.mode is ForwardMode.DECODE and self.buckets.bucket_for(batch.batch_size) is not None

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """float32 logits [batch_size, vocab] of a DECODE batch (writes its K/V)."""
        size = self.buckets.bucket_for(batch.batch_size)
        assert size is not None and batch.mode is ForwardMode.DECODE, "can_run() first"
        padded = self.inputs.load(batch, size)
        self._metadata(padded, size)
        try:
            return self._steps[size]()[: batch.batch_size]
        finally:
            self.backend.use_decode_bucket(None)
