"""--enable-torch-compile on CPU: the decode step compiled by inductor, one graph per batch-size bucket.

    DecodeGraphRunner (decode_graphs.py)  padded bucket batch -> CompileCapture.capture(size, step)
    CompileCapture                         torch.compile(step, dynamic=False, fullgraph=True),
                                           run once at startup (the compile), then replayed
    inside the graph                       embedding, norms, rope, SiLU: fused C++/OpenMP; linears
                                           and logits: buckets of <= COMPILED_TEMPLATE_MAX_ROWS
                                           rows autotune (max-autotune) F.linear on the plain
                                           weights: inductor's C++ GEMM template, or its int8
                                           template with --quantization int8; larger buckets call
                                           oneDNN's packed linear (PackedLinear), no autotuning
    outside it (one opaque op per layer)   pdserve::paged_attention: the KV write at out_cache_loc
                                           + the backend's attention over this step's metadata

The attention stays eager because its shapes follow the sequence lengths of each step (the
backend plans groups per step); the op keeps the graph whole, so dynamo traces the 30-layer
step once per bucket instead of breaking at every layer. Inductor's FX graph cache lives
under TORCHINDUCTOR_CACHE_DIR (default: a "torchinductor" folder in the system temp dir), so
a restart on the same box recompiles from the cache.

Measured on an AMD EPYC with avx512_bf16, 2 cores, SmolLM2-135M bf16, decode forward ms
(eager = prepacked oneDNN):   batch 1: eager 24.7, compiled 20.6, compiled + max-autotune 12.8;
batch 32: 54.6, 46.7, 46.9; with --quantization int8 and max-autotune: 9.7 / 54.0. On an AVX2
EPYC (fp32), where max-autotune at batch 32 chose GEMMs slower than oneDNN's (0.75x eager), the
split by bucket gives b1 1.75x, b4 1.46x, b8 1.19x, b32 1.10x the eager step. Autotuning costs
~1 min per small bucket on the first start (a progress line per bucket).
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import cast

import torch

from common.cache.kv_pool import KVPool
from common.model import packed_linear
from common.model.attention.base import AttentionBackend
from common.model.decode_graphs import EagerCapture, Step
from common.model.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

_ATTENTION: dict[int, tuple[KVPool, AttentionBackend]] = {}
_KEYS = itertools.count(1)


def write_kv(pool: KVPool, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """KVPool.set_kv: row copies into the pool's 2-D [rows, Hkv*D] view (kv_pool.py). NOTE: on CPU,
    index_put into a multi-dim buffer takes a per-element path ~100-1000x slower (bf16)."""
    pool.set_kv(layer, slots, k, v)


@torch.library.custom_op("pdserve::paged_attention", mutates_args=())
def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out_cache_loc: torch.Tensor, layer_id: int, key: int
) -> torch.Tensor:
    """write_kv + backend.forward of the backend registered under `key` (its metadata of this
    step is already built). Backends read their metadata in forward(), not the batch."""
    pool, backend = _ATTENTION[key]
    write_kv(pool, layer_id, out_cache_loc, k, v)
    return backend.forward(q, k, v, layer_id, cast(ForwardBatch, None))


@paged_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out_cache_loc: torch.Tensor, layer_id: int, key: int) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


def attention_key(backend: AttentionBackend) -> int | None:
    """The key under which a compiled step finds `backend` (None: not registered)."""
    return getattr(backend, "compiled_attention_key", None)


def register_attention(pool: KVPool, backend: AttentionBackend) -> int:
    key = next(_KEYS)
    _ATTENTION[key] = (pool, backend)
    backend.compiled_attention_key = key  # type: ignore[attr-defined]
    return key


class CompileCapture(EagerCapture):
    """Each bucket's step through torch.compile (inductor, CPU), compiled at capture time."""

    def __init__(self, pool: KVPool, backend: AttentionBackend) -> None:
        import torch._inductor.config as inductor_config

        inductor_config.freezing = True  # weights as constants: the GEMM template packs the plain ones
        inductor_config.max_autotune_gemm_backends = "CPP,ATEN"
        inductor_config.autotune_num_choices_displayed = 0  # no timing table per shape in the log
        inductor_config.max_autotune_report_choices_stats = False
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        register_attention(pool, backend)

    def capture(self, size: int, step: Step) -> Step:
        """Compiles on the first call. Buckets of up to COMPILED_TEMPLATE_MAX_ROWS rows autotune
        their linears (the GEMM template on the plain weights); larger ones keep oneDNN's packed
        linears (PackedLinear) and fuse the rest."""
        import torch._inductor.config as inductor_config

        start = time.perf_counter()
        compiled = cast(Step, torch.compile(step, dynamic=False, fullgraph=True))
        with inductor_config.patch(max_autotune=size <= packed_linear.COMPILED_TEMPLATE_MAX_ROWS):
            compiled()
        logger.info("torch.compile: decode step for batch size %d compiled in %.1f s", size, time.perf_counter() - start)
        return compiled
