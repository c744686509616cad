"""Runs the model on a ForwardBatch and returns next-token logits.

Who owns what: the runner owns the model weights and the attention backend.
The KV pool and the req_to_token table are owned by the engine (the scheduler
decides which slots each request uses); the runner writes K/V only at
batch.out_cache_loc and reads them through req_to_token.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import torch

from common.cache.kv_pool import KVPool
from common.model.attention import AttentionShape, create_attention_backend
from common.model.config import ModelConfig, resolve_dtype
from common.model.decode_graphs import DecodeGraphRunner, EagerCapture, StepCapture
from common.model.device_streams import DeviceStreams, make_device_streams
from common.model.forward_batch import ForwardBatch, ForwardMode
from common.model.fused_ops import select_fused_ops
from common.model.int8_linear import check_quantization
from common.model.loader import build_model
from common.model.packed_linear import padded_rows, prepack_supported
from common.model.tensor_parallel import NO_TP, TPGroup, TPShard

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model_path: str,
        *,
        dtype: str | torch.dtype = "auto",
        device: torch.device | str = "cpu",
        kv_pool: KVPool | Callable[[], KVPool],
        req_to_token: torch.Tensor,
        attention_backend: str = "auto",
        cpu_weight_prepack: bool = True,
        keep_plain_weights: bool = False,
        streams: DeviceStreams | None = None,
        tp: TPGroup = NO_TP,
        quantization: str | None = None,
        prefill_row_bucket: int = 0,
    ) -> None:
        """model_path: an HF checkpoint dir (see default_model.resolve_model_path for "default").
        kv_pool: the pool, or a function that builds it, called once the weights are loaded (so a
        GPU pool can be sized from the memory the weights left, see memory_budget.py).
        cpu_weight_prepack: on CPU, run the linears through oneDNN on weights packed once
        (packed_linear.py; where the dtype is native to the CPU).
        keep_plain_weights: keep each prepacked linear's plain weight too, for the compiled decode
        steps of the smallest buckets (--enable-torch-compile; COMPILED_TEMPLATE_MAX_ROWS).
        streams: host <-> device staging and ordering of the worker (device_streams.py); by
        default the device's own (a worker stream on CUDA).
        tp: this rank's tensor-parallel group; the runner holds its TPShard of the weights and
        the KV pool holds that shard's KV heads.
        quantization: None, or "int8" (weight-only, CPU with bfloat16 activations; int8_linear.py).
        prefill_row_bucket: CPU, prepacked linears: extend (prefill) forwards pad each linear's rows
        to packed_linear.bucket_rows(rows, this) (0: off), bounding oneDNN's primitive shapes."""
        self.model_config = ModelConfig.from_pretrained(model_path)
        self.tp = tp
        self.shard = TPShard.of(self.model_config, tp.rank, tp.size)
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.req_to_token = req_to_token
        self.streams = streams or make_device_streams(self.device)
        self.prefill_row_bucket = prefill_row_bucket
        if isinstance(kv_pool, KVPool):
            self._check_kv_memory(kv_pool)
        start = time.perf_counter()
        self.model = build_model(self.model_config, dtype=self.dtype, device=self.device, shard=self.shard, tp=tp)
        self.model.ops = select_fused_ops(self.device, self.dtype)
        self.model.ops.check(self.model.rope, self.shard.num_heads, self.shard.num_kv_heads, self.device, self.dtype)
        check_quantization(quantization, self.device, self.dtype)
        self.weights_prepacked = quantization is None and cpu_weight_prepack and prepack_supported(self.device, self.dtype)
        if quantization == "int8":
            self.model.quantize_int8(self.dtype)
        elif self.weights_prepacked:
            self.model.prepack_for_cpu(keep_plain_weights)
        logger.info(
            "loaded %s (%s, %d layers) as %s on %s in %.1f s%s",
            model_path,
            self.model_config.architecture,
            self.model_config.num_layers,
            str(self.dtype).removeprefix("torch."),
            self.device,
            time.perf_counter() - start,
            (", linears prepacked for oneDNN" if self.weights_prepacked else "")
            + (", linears weight-only int8" if quantization == "int8" else "") + f", {self.model.ops.name} norm/act ops",
        )
        if not isinstance(kv_pool, KVPool):
            kv_pool = kv_pool()
            self._check_kv_memory(kv_pool)
        self.kv_pool = kv_pool
        shape = AttentionShape(
            num_heads=self.shard.num_heads,
            num_kv_heads=self.shard.num_kv_heads,
            head_dim=self.model_config.head_dim,
            scaling=self.model_config.head_dim**-0.5,
        )
        self.decode_graphs: DecodeGraphRunner | None = None
        self.attn_backend = create_attention_backend(
            attention_backend, shape=shape, kv_pool=kv_pool, req_to_token=req_to_token, streams=self.streams
        )

    def _check_kv_memory(self, kv_pool: KVPool) -> None:
        _check_pool(self.model_config, self.shard, kv_pool, self.device)
        if self.req_to_token.device != kv_pool.device:
            raise ValueError(f"req_to_token is on {self.req_to_token.device}, the KV pool on {kv_pool.device}")

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @torch.inference_mode()
    def enable_decode_graphs(self, max_bs: int, capture: StepCapture) -> None:
        """Run decode batches of up to max_bs rows through one captured step per batch-size
        bucket (decode_graphs.py); call before the first step."""
        if not self.attn_backend.graph_capturable and not isinstance(capture, EagerCapture):
            raise ValueError(f"the {type(self.attn_backend).__name__} cannot be captured in a CUDA graph")
        self.decode_graphs = DecodeGraphRunner(self.model, self.kv_pool, self.attn_backend, max_bs=max_bs, capture=capture)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """float32 logits [batch_size, vocab] of each request's last token (writes the step's K/V).
        A DECODE step through decode graphs returns a view of its bucket's static output: use it
        (sample) before the next forward, or copy it."""
        if batch.mode == ForwardMode.IDLE or batch.batch_size == 0:
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        if self.decode_graphs is not None and self.decode_graphs.can_run(batch):
            self._check(batch)
            return self.decode_graphs.forward(batch)
        return self.model.compute_logits(self.forward_hidden(batch))

    @torch.inference_mode()
    def forward_hidden(self, batch: ForwardBatch, *, all_tokens: bool = False) -> torch.Tensor:
        """Final hidden states of the last token of each request, or of every token."""
        self._check(batch)
        self.attn_backend.init_forward_metadata(batch)
        pad = self.weights_prepacked and self.prefill_row_bucket > 0 and batch.mode != ForwardMode.DECODE
        with padded_rows(self.prefill_row_bucket) if pad else contextlib.nullcontext():
            return self.model(batch, self.kv_pool, self.attn_backend, all_tokens=all_tokens)

    def _check(self, batch: ForwardBatch) -> None:
        if min(batch.extend_lens_cpu, default=1) < 1:
            raise ValueError(f"every request needs >= 1 new token, got extend_lens {batch.extend_lens_cpu}")
        if max(batch.seq_lens_cpu, default=0) > self.model_config.context_length:
            raise ValueError(
                f"sequence of {max(batch.seq_lens_cpu)} tokens exceeds the context length "
                f"{self.model_config.context_length}"
            )

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    @staticmethod
    def create_kv_pool(
        config: ModelConfig,
        *,
        max_total_tokens: int,
        page_size: int,
        dtype: str | torch.dtype = "auto",
        device: torch.device | str = "cpu",
        streams: DeviceStreams | None = None,
        shard: TPShard | None = None,
        shared_path: str | None = None,
    ) -> KVPool:
        """A pool holding at least `max_total_tokens` token slots (plus the reserved page 0), of
        `shard`'s KV heads (default: all of them)."""
        if max_total_tokens < 1 or page_size < 1:
            raise ValueError(f"need max_total_tokens >= 1 and page_size >= 1, got {max_total_tokens}, {page_size}")
        num_pages = 1 + (max_total_tokens + page_size - 1) // page_size
        return KVPool(
            num_layers=config.num_layers,
            num_pages=num_pages,
            page_size=page_size,
            num_kv_heads=(shard or TPShard.of(config)).num_kv_heads,
            kv_head_start=(shard or TPShard.of(config)).kv_head_start,
            head_dim=config.head_dim,
            dtype=resolve_dtype(dtype, device),
            device=device,
            streams=streams,
            shared_path=shared_path,
        )

    @staticmethod
    def kv_bytes_per_token(
        config: ModelConfig, dtype: str | torch.dtype = "auto", device: str = "cpu", shard: TPShard | None = None
    ) -> int:
        itemsize = torch.empty((), dtype=resolve_dtype(dtype, device)).element_size()
        return 2 * config.num_layers * (shard or TPShard.of(config)).kv_size * itemsize


def _check_pool(config: ModelConfig, shard: TPShard, pool: KVPool, device: torch.device) -> None:
    want = (config.num_layers, shard.num_kv_heads, config.head_dim)
    have = (pool.num_layers, pool.num_kv_heads, pool.head_dim)
    if want != have:
        raise ValueError(f"KV pool (layers, kv_heads, head_dim) = {have} does not fit the model's {want}")
    if pool.device.type != device.type:
        raise ValueError(f"KV pool is on {pool.device}, the model on {device}")
