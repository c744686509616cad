"""Megatron-style tensor parallelism: which slice of the model a rank holds, and its collectives.

    TPShard   pure arithmetic: this rank's heads, KV heads, MLP columns and vocab rows, and
              the matching slice of each checkpoint tensor (the loader applies it)
    TPGroup   the rank's torch.distributed groups: all-reduce after the row-parallel linears
              (o_proj, down_proj) and the vocab-parallel embedding, all-gather of the logits,
              broadcast of the sampled tokens. size 1 never touches torch.distributed.

Column-parallel (output split): qkv_proj by heads, gate_up_proj by intermediate columns,
lm_head and embed_tokens by vocab rows (padded to a multiple of the TP size).
Row-parallel (input split, all-reduce after): o_proj, down_proj; a row-parallel bias lives on
rank 0 only (zeros elsewhere), so the all-reduce adds it once.
KV heads are split when num_kv_heads >= size, else each rank keeps the one KV head its query
heads use (replicated across size // num_kv_heads ranks).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from common.model.config import ModelConfig, ModelConfigError

_COLUMN_HEAD = re.compile(r"\.(q_proj|k_proj|v_proj)\.(weight|bias)$")
_COLUMN_MLP = re.compile(r"\.(gate_proj|up_proj)\.weight$")
_ROW = re.compile(r"\.(o_proj|down_proj)\.weight$")
_ROW_BIAS = re.compile(r"\.o_proj\.bias$")
_VOCAB = re.compile(r"^(model\.embed_tokens|lm_head)\.weight$")


@dataclass(frozen=True)
class TPShard:
    """This rank's slice of a model; TPShard.of(config) with size 1 is the whole model."""

    rank: int
    size: int
    head_dim: int
    num_heads: int  # query heads held here
    head_start: int
    num_kv_heads: int  # KV heads held (and cached) here
    kv_head_start: int
    intermediate_size: int
    vocab_size: int  # rows of embed_tokens / lm_head held here (padded)
    vocab_start: int
    full_vocab_size: int

    @classmethod
    def of(cls, config: ModelConfig, rank: int = 0, size: int = 1) -> TPShard:
        problem = tp_problem(config, size)
        if problem is not None:
            raise ModelConfigError(problem)
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} outside TP size {size}")
        heads = config.num_heads // size
        kv = config.num_kv_heads
        vocab = -(-config.vocab_size // size)
        return cls(
            rank=rank,
            size=size,
            head_dim=config.head_dim,
            num_heads=heads,
            head_start=rank * heads,
            num_kv_heads=max(1, kv // size),
            kv_head_start=rank * kv // size,
            intermediate_size=config.intermediate_size // size,
            vocab_size=vocab,
            vocab_start=rank * vocab,
            full_vocab_size=config.vocab_size,
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def checkpoint_slice(self, name: str, tensor: Any) -> torch.Tensor:
        """The part of checkpoint tensor `name` this rank loads (the tensor itself at size 1).
        `tensor` may be a lazy safetensors slice: only this rank's part is then read."""
        if self.size == 1:
            return tensor if isinstance(tensor, torch.Tensor) else tensor[:]
        d = self.head_dim
        m = _COLUMN_HEAD.search(name)
        if m is not None:
            start, n = (self.head_start, self.num_heads) if m.group(1) == "q_proj" else (
                self.kv_head_start, self.num_kv_heads)
            return tensor[start * d : (start + n) * d]
        if _COLUMN_MLP.search(name):
            return tensor[self.rank * self.intermediate_size : (self.rank + 1) * self.intermediate_size]
        m = _ROW.search(name)
        if m is not None:
            start, n = (self.head_start * d, self.q_size) if m.group(1) == "o_proj" else (
                self.rank * self.intermediate_size, self.intermediate_size)
            return tensor[:, start : start + n]
        if _ROW_BIAS.search(name):
            return tensor[:] if self.rank == 0 else torch.zeros_like(tensor[:])
        if _VOCAB.match(name):
            rows = tensor[self.vocab_start : self.vocab_start + self.vocab_size]
            if rows.shape[0] < self.vocab_size:  # the last rank's padding rows stay zero
                rows = torch.cat([rows, rows.new_zeros(self.vocab_size - rows.shape[0], *rows.shape[1:])])
            return rows
        return tensor[:]


def tp_problem(config: ModelConfig, size: int) -> str | None:
    """Why `config` cannot be split `size` ways (None when it can)."""
    if size < 1:
        return f"--tp-size must be >= 1, got {size}"
    kv = config.num_kv_heads
    if config.num_heads % size:
        return f"--tp-size {size} does not divide the {config.num_heads} attention heads"
    if kv % size and size % kv:
        return f"--tp-size {size} and the {kv} KV heads: one must divide the other"
    if config.intermediate_size % size:
        return f"--tp-size {size} does not divide intermediate_size {config.intermediate_size}"
    return None


class TPGroup:
    """A rank's collectives. `device_group` carries activations (NCCL on CUDA, gloo on CPU;
    None: the default group); `cpu_group` (gloo, CUDA only) carries host-side agreement."""

    def __init__(self, rank: int = 0, size: int = 1, device_group: Any = None, cpu_group: Any = None) -> None:
        self.rank = rank
        self.size = size
        self.device_group = device_group
        self.cpu_group = cpu_group

    def barrier(self) -> None:
        if self.size > 1:
            torch.distributed.barrier(group=self.cpu_group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.device_group)
        return x

    def gather_vocab(self, logits: torch.Tensor, full_vocab: int) -> torch.Tensor:
        """[n, vocab/size] on each rank -> [n, vocab] on every rank."""
        if self.size == 1:
            return logits
        logits = logits.contiguous()
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        torch.distributed.all_gather(parts, logits, group=self.device_group)
        return torch.cat(parts, dim=-1)[..., :full_vocab]

    def broadcast_(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank (in place)."""
        if self.size > 1:
            torch.distributed.broadcast(x, src=0, group=self.device_group)
        return x


NO_TP = TPGroup()
