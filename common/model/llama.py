"""Native Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV pool.

One implementation covers the four layouts; they differ only in
ModelConfig.qkv_bias / o_bias (Qwen2, biased Llama) and qk_norm (Qwen3).
q/k/v and gate/up projections are fused into one matmul each; the loader
splits the checkpoint tensors into them.

    tokens -> embed -> [ RMSNorm -> attention -> + -> RMSNorm -> SiLU MLP -> + ] x L -> RMSNorm

Each "+ -> RMSNorm" is one add_rms_norm (fused_ops.py: one flashinfer kernel on a GPU), so a
layer hands the next its MLP output and the residual stream separately.
    attention: qkv_proj -> (q/k norm) -> rope -> KV pool write -> backend -> o_proj
               (rope + KV write is one fused_ops.rope_kv: one C call on CPU in bf16)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.cache.kv_pool import KVPool
from common.model.attention.base import AttentionBackend
from common.model.compiled_decode import attention_key, write_kv
from common.model.config import ModelConfig
from common.model.forward_batch import ForwardBatch
from common.model.fused_ops import TorchOps
from common.model.int8_linear import Int8Linear, quantize_linears
from common.model.packed_linear import PackedLinear, prepack_linears
from common.model.rope import RopeTable, RotaryEmbedding
from common.model.tensor_parallel import NO_TP, TPGroup, TPShard

TORCH_OPS = TorchOps()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor, ops: TorchOps = TORCH_OPS) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor, ops: TorchOps) -> tuple[torch.Tensor, torch.Tensor]:
        """(rmsnorm(x + residual), x + residual)"""
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, shard: TPShard, tp: TPGroup) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.tp = tp
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, config.head_dim
        self.sizes = [shard.q_size, shard.kv_size, shard.kv_size]
        self.qkv_proj = nn.Linear(config.hidden_size, sum(self.sizes), bias=config.qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(shard.q_size, config.hidden_size, bias=config.o_bias, dtype=dtype)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        rope: RopeTable,
        kv_pool: KVPool,
        backend: AttentionBackend,
        ops: TorchOps = TORCH_OPS,
    ) -> torch.Tensor:
        # one view + one split (strided [n, heads, D] views of the qkv rows): 2 operators, not 4
        qkv = self.qkv_proj(x).view(x.shape[0], -1, self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, written = ops.rope_kv(q, k, v, rope, kv_pool, self.layer_id, batch.out_cache_loc)
        return self.tp.all_reduce(self.o_proj(_attend(q, k, v, self.layer_id, batch, kv_pool, backend, written)))


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch, pool: KVPool,
    backend: AttentionBackend, written: bool = False,
) -> torch.Tensor:
    """Write this step's K/V (unless the fused rope already did: `written`), then attention;
    inside a compiled decode step one opaque op."""
    key = attention_key(backend)
    if key is not None and torch.compiler.is_compiling() and not written:
        out: torch.Tensor = torch.ops.pdserve.paged_attention(q, k, v, batch.out_cache_loc, layer, key)
        return out
    if not written:
        write_kv(pool, layer, batch.out_cache_loc, k, v)
    return backend.forward(q, k, v, layer, batch)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, shard: TPShard, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * shard.intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(shard.intermediate_size, config.hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(ops.silu_and_mul(self.gate_up_proj(x))))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, shard: TPShard, tp: TPGroup) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, dtype, shard, tp)
        self.mlp = LlamaMLP(config, dtype, shard, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        rope: RopeTable,
        kv_pool: KVPool,
        backend: AttentionBackend,
        ops: TorchOps,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it); the next layer (or the
        final norm) adds the two. residual None: x is the embedding."""
        if residual is None:
            residual, h = x, self.input_layernorm(x, ops)
        else:
            h, residual = self.input_layernorm.add(x, residual, ops)
        h = self.self_attn(h, batch, rope, kv_pool, backend, ops)
        h, residual = self.post_attention_layernorm.add(h, residual, ops)
        return self.mlp(h, ops), residual


class VocabParallelEmbedding(nn.Embedding):
    """nn.Embedding over this rank's vocab rows; ids elsewhere read zeros, summed across ranks."""

    def __init__(self, shard: TPShard, hidden_size: int, dtype: torch.dtype, tp: TPGroup) -> None:
        # _weight: no random init (the loader writes every row); nn.Embedding's init on the
        # meta device would import torch._dynamo, ~1.5 s of every engine start
        super().__init__(shard.vocab_size, hidden_size, _weight=torch.empty(shard.vocab_size, hidden_size, dtype=dtype))
        self.vocab_start = shard.vocab_start
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[:, None], 0.0)
        return self.tp.all_reduce(x)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, shard: TPShard, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(shard, config.hidden_size, dtype, tp)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, i, dtype, shard, tp) for i in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class LlamaForCausalLM(nn.Module):
    """Parameters mirror HF names, except the fused qkv_proj / gate_up_proj (see loader.py).

    Build it under `torch.device("meta")` and materialise with `to_empty` + the loader;
    `rope` is built separately on the real device (it is a table, not a parameter).
    Under tensor parallelism (tensor_parallel.py) it holds `shard` of the weights and joins
    the other ranks through `tp` in every forward.
    """

    def __init__(
        self,
        config: ModelConfig,
        rope: RotaryEmbedding,
        dtype: torch.dtype,
        shard: TPShard | None = None,
        tp: TPGroup = NO_TP,
    ) -> None:
        super().__init__()
        self.config = config
        self.shard = shard or TPShard.of(config)
        self.tp = tp
        self.rope = rope
        self.model = LlamaModel(config, dtype, self.shard, tp)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, self.shard.vocab_size, bias=False, dtype=dtype)
        )
        self.head_linear: PackedLinear | Int8Linear | None = None  # set by prepack_for_cpu / quantize_int8
        self.ops: TorchOps = TORCH_OPS  # the runner picks flashinfer's fused kernels where they run

    def prepack_for_cpu(self, keep_plain: bool = False) -> None:
        """Every linear of the decoder, and the logits projection, as oneDNN packed linears
        (packed_linear.py), keeping the plain weights too with `keep_plain`. Call once the
        weights are loaded."""
        prepack_linears(self.model, keep_plain)
        self.head_linear = PackedLinear(self._head_weight(), None, keep_plain)

    def quantize_int8(self, act_dtype: torch.dtype) -> None:
        """Every linear of the decoder, and the logits projection (a copy when it is tied to the
        embeddings), as weight-only int8 linears (int8_linear.py). Call once the weights are loaded."""
        quantize_linears(self.model, act_dtype)
        self.head_linear = Int8Linear(self._head_weight(), None, act_dtype)

    def _head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self, batch: ForwardBatch, kv_pool: KVPool, backend: AttentionBackend, *, all_tokens: bool = False
    ) -> torch.Tensor:
        """Final hidden states: of each request's last token [batch_size, hidden], or of every
        token [num_tokens, hidden] with all_tokens=True. Writes this step's K/V into kv_pool."""
        x = self.model.embed_tokens(batch.input_ids)
        rope = self.rope.table(batch.positions)
        residual: torch.Tensor | None = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, batch, rope, kv_pool, backend, self.ops)
        assert residual is not None, "a model without layers"
        if not all_tokens and batch.last_index is not None:
            x, residual = x[batch.last_index], residual[batch.last_index]
        return self.model.norm.add(x, residual, self.ops)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.head_linear is not None:
            logits = self.head_linear(hidden).float()
        else:
            logits = F.linear(hidden, self._head_weight()).float()
        return self.tp.gather_vocab(logits, self.config.vocab_size)
