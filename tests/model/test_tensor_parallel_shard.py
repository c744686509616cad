"""TPShard: each rank's slice of every checkpoint tensor, and which splits are refused.

The slices of all ranks put back together must be the checkpoint tensor (column-parallel:
rows; row-parallel: columns; vocab rows padded with zeros), and a rank's q heads must use
exactly the KV heads it holds (GQA groups never straddle ranks)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.model.config import ModelConfig, ModelConfigError
from common.model.tensor_parallel import TPShard, tp_problem


def _config(tiny_llama_path: str, **changes: int) -> ModelConfig:
    return dataclasses.replace(ModelConfig.from_pretrained(tiny_llama_path), **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(("heads", "kv_heads", "size"), [(4, 2, 2), (4, 4, 2), (4, 2, 4), (8, 1, 4), (4, 4, 4)])
def test_slices_of_all_ranks_rebuild_each_tensor(tiny_llama_path: str, heads: int, kv_heads: int, size: int) -> None:
    config = _config(tiny_llama_path, num_heads=heads, num_kv_heads=kv_heads, head_dim=8, vocab_size=383)
    shards = [TPShard.of(config, r, size) for r in range(size)]
    d, hidden, inter = 8, config.hidden_size, config.intermediate_size
    q, kv = torch.randn(heads * d, hidden), torch.randn(kv_heads * d, hidden)
    gate, down, o = torch.randn(inter, hidden), torch.randn(hidden, inter), torch.randn(hidden, heads * d)
    emb, o_bias = torch.randn(383, hidden), torch.randn(hidden)
    cat = torch.cat
    assert torch.equal(cat([s.checkpoint_slice("model.layers.0.self_attn.q_proj.weight", q) for s in shards]), q)
    assert torch.equal(cat([s.checkpoint_slice("model.layers.0.mlp.gate_proj.weight", gate) for s in shards]), gate)
    assert torch.equal(cat([s.checkpoint_slice("model.layers.1.mlp.down_proj.weight", down) for s in shards], 1), down)
    assert torch.equal(cat([s.checkpoint_slice("model.layers.1.self_attn.o_proj.weight", o) for s in shards], 1), o)
    rows = cat([s.checkpoint_slice("lm_head.weight", emb) for s in shards])
    assert rows.shape[0] == shards[0].vocab_size * size and torch.equal(rows[:383], emb) and not rows[383:].any()
    assert torch.equal(sum(s.checkpoint_slice("model.layers.0.self_attn.o_proj.bias", o_bias) for s in shards), o_bias)
    norm = torch.randn(hidden)
    assert all(torch.equal(s.checkpoint_slice("model.norm.weight", norm), norm) for s in shards)
    group = heads // kv_heads
    for s in shards:
        k = s.checkpoint_slice("model.layers.0.self_attn.k_proj.weight", kv)
        assert torch.equal(k, kv[s.kv_head_start * d : (s.kv_head_start + s.num_kv_heads) * d])
        used = {h // group for h in range(s.head_start, s.head_start + s.num_heads)}
        assert used == set(range(s.kv_head_start, s.kv_head_start + s.num_kv_heads))


def test_size_one_is_the_whole_model(tiny_llama_path: str) -> None:
    config = _config(tiny_llama_path)
    shard = TPShard.of(config)
    t = torch.randn(4, 4)
    assert (shard.num_heads, shard.num_kv_heads, shard.vocab_size) == (
        config.num_heads, config.num_kv_heads, config.vocab_size)
    assert shard.checkpoint_slice("model.layers.0.self_attn.q_proj.weight", t) is t


def test_splits_that_cannot_work_are_refused(tiny_llama_path: str) -> None:
    assert "attention heads" in (tp_problem(_config(tiny_llama_path, num_heads=6, num_kv_heads=6), 4) or "")
    assert "KV heads" in (tp_problem(_config(tiny_llama_path, num_heads=12, num_kv_heads=3), 2) or "")
    assert "intermediate_size" in (tp_problem(_config(tiny_llama_path, intermediate_size=130), 4) or "")
    with pytest.raises(ModelConfigError, match="attention heads"):
        TPShard.of(_config(tiny_llama_path, num_heads=6, num_kv_heads=6), 0, 4)
