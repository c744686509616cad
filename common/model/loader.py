"""Build the native model and fill it from an HF safetensors checkpoint.

Checkpoint names map onto our parameters one to one, except the fused projections:

    model.layers.N.self_attn.{q,k,v}_proj.{weight,bias} -> self_attn.qkv_proj   rows [q | k | v]
    model.layers.N.mlp.{gate,up}_proj.weight             -> mlp.gate_up_proj     rows [gate | up]

Every parameter (and every shard of a fused one) must be written exactly once;
anything missing, unexpected or of the wrong shape raises WeightLoadError
naming the tensors, before the model is used. Under tensor parallelism each rank reads
only its slice of every tensor (TPShard.checkpoint_slice).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from common.model.config import ModelConfig
from common.model.llama import LlamaForCausalLM
from common.model.rope import RotaryEmbedding
from common.model.tensor_parallel import NO_TP, TPGroup, TPShard

_FUSED = re.compile(r"^(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")
_FUSED_INTO = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
_FUSED_INTO |= {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


class WeightLoadError(RuntimeError):
    """The checkpoint's tensors do not fit the model (the message names them)."""


def build_model(
    config: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    shard: TPShard | None = None,
    tp: TPGroup = NO_TP,
) -> LlamaForCausalLM:
    """Allocate the model (or this rank's `shard` of it) on `device` in `dtype` and load the
    checkpoint at config.model_path."""
    rope = RotaryEmbedding(config, device)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, rope, dtype, shard, tp)
    # to_empty() would run torch.empty_like on meta tensors, whose Python reference imports
    # sympy (~0.8 s of every engine start); a plain torch.empty of the same shape does not
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    load_weights(model, config.model_path)
    return model.eval()


def _splits(shard: TPShard) -> dict[str, list[int]]:
    """Rows of each part of the fused parameters (as this rank holds them), in order."""
    return {
        "qkv_proj": [shard.q_size, shard.kv_size, shard.kv_size],
        "gate_up_proj": [shard.intermediate_size, shard.intermediate_size],
    }


def _expected_shards(model: LlamaForCausalLM) -> dict[tuple[str, int], int]:
    """(parameter, first row) -> rows, for every shard the checkpoint must provide."""
    splits = _splits(model.shard)
    shards: dict[tuple[str, int], int] = {}
    for name, p in model.named_parameters():
        start = 0
        for rows in splits.get(name.split(".")[-2], [p.shape[0]]):
            shards[(name, start)] = rows
            start += rows
    return shards


def _target(shard: TPShard, name: str) -> tuple[str, int]:
    """Checkpoint tensor name -> (our parameter, first row)."""
    m = _FUSED.match(name)
    if m is None:
        return name, 0
    prefix, proj, kind = m.groups()
    fused, index = _FUSED_INTO[proj]
    return f"{prefix}.{fused}.{kind}", sum(_splits(shard)[fused][:index])


def checkpoint_files(model_path: str | Path) -> list[Path]:
    path = Path(model_path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = [path / f for f in dict.fromkeys(weight_map.values())]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise WeightLoadError(f"{index} lists missing shard file(s): {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors weights in {path} (other formats are not supported)")
    return files


def load_weights(model: LlamaForCausalLM, model_path: str | Path) -> None:
    config = model.config
    params = dict(model.named_parameters())
    todo = _expected_shards(model)
    unexpected: list[str] = []
    for file in checkpoint_files(model_path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if _IGNORED.search(name) or (name == "lm_head.weight" and config.tie_word_embeddings):
                    continue
                pname, start = _target(model.shard, name)
                rows = todo.pop((pname, start), None)
                if rows is None:
                    unexpected.append(name)
                    continue
                param = params[pname]
                # TP: read only this rank's part of the tensor
                lazy = f.get_tensor(name) if model.shard.size == 1 else f.get_slice(name)
                tensor = model.shard.checkpoint_slice(name, lazy)
                expected = (rows, *param.shape[1:])
                if tuple(tensor.shape) != expected:
                    raise WeightLoadError(f"{file.name}: {name} has shape {tuple(tensor.shape)}, expected {expected}")
                with torch.no_grad():
                    param.data[start : start + rows].copy_(tensor)
    if unexpected:
        raise WeightLoadError(f"unexpected tensor(s) in {model_path}: {', '.join(sorted(unexpected)[:10])}")
    if todo:
        missing = sorted(f"{p}[{s}:{s + n}]" for (p, s), n in todo.items())
        raise WeightLoadError(f"missing tensor(s) in {model_path}: {', '.join(missing[:10])}")
