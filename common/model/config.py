"""What the model runner needs to know about a checkpoint, read once from its config.json.

`ModelConfig.from_pretrained(dir)` reads an HF checkpoint directory (its config.json as it
is when that names every field, else through transformers.AutoConfig; plus
generation_config.json for extra EOS ids) and
normalises the four supported layouts (llama, mistral, qwen2, qwen3) into one
frozen record. Anything the native model cannot run exactly (another
architecture, a rope type that depends on the batch, an activation other than
SiLU) is refused here with a ModelConfigError, before any weight is read.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import torch

from common.model.context_length import model_context_length
from common.model.plain_config import read_plain_config

logger = logging.getLogger(__name__)

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
# Rope types whose frequencies are fixed at load time (so the KV cache stays valid).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelConfigError(ValueError):
    """The checkpoint cannot be served by the native model (the message says why)."""


@dataclass(frozen=True)
class ModelConfig:
    model_path: str
    architecture: str  # one of SUPPORTED_ARCHS
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_type: str  # one of STATIC_ROPE_TYPES
    rope_scaling: dict[str, Any] | None  # the scaling parameters when rope_type != "default"
    tie_word_embeddings: bool
    qkv_bias: bool  # qwen2, or llama with attention_bias
    o_bias: bool  # llama with attention_bias
    qk_norm: bool  # qwen3: RMSNorm over head_dim on q and k before rope
    context_length: int
    eos_token_ids: tuple[int, ...]
    checkpoint_dtype: str  # dtype the weights are stored in, e.g. "bfloat16"
    hf_config: Any = field(default=None, repr=False, compare=False)  # transformers PretrainedConfig

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_pretrained(cls, model_path: str | os.PathLike[str]) -> ModelConfig:
        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise ModelConfigError(
                f"{str(path)!r} is not a checkpoint directory (no config.json); "
                "pass an HF checkpoint dir or use common.model.default_model.resolve_model_path"
            )
        hf: Any = read_plain_config(path)
        if hf is None:
            from transformers import AutoConfig

            try:
                hf = AutoConfig.from_pretrained(str(path))
            except (ValueError, KeyError, OSError) as e:
                raise ModelConfigError(f"cannot read {path / 'config.json'}: {e}") from e
        return cls.from_hf_config(hf, str(path))

    @classmethod
    def from_hf_config(cls, hf: Any, model_path: str) -> ModelConfig:
        arch = getattr(hf, "model_type", None)
        if arch not in SUPPORTED_ARCHS:
            raise ModelConfigError(
                f"unsupported architecture {arch!r} ({getattr(hf, 'architectures', None)}); "
                f"supported: {', '.join(SUPPORTED_ARCHS)}"
            )
        act = getattr(hf, "hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(f"unsupported activation {act!r}: only silu is implemented")
        if getattr(hf, "mlp_bias", False):
            raise ModelConfigError("unsupported: mlp_bias=True")
        num_heads = int(hf.num_attention_heads)
        head_dim = int(getattr(hf, "head_dim", None) or hf.hidden_size // num_heads)
        rope_theta, rope_type, rope_scaling = _rope_params(hf)
        attention_bias = bool(getattr(hf, "attention_bias", False))
        return cls(
            model_path=model_path,
            architecture=arch,
            num_layers=int(hf.num_hidden_layers),
            hidden_size=int(hf.hidden_size),
            num_heads=num_heads,
            num_kv_heads=int(getattr(hf, "num_key_value_heads", None) or num_heads),
            head_dim=head_dim,
            intermediate_size=int(hf.intermediate_size),
            vocab_size=int(hf.vocab_size),
            rms_norm_eps=float(hf.rms_norm_eps),
            rope_theta=rope_theta,
            rope_type=rope_type,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or attention_bias,
            o_bias=arch in ("llama", "mistral") and attention_bias,
            qk_norm=arch == "qwen3",
            context_length=_context_length(hf),
            eos_token_ids=_eos_token_ids(hf, model_path),
            checkpoint_dtype=str(getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None) or "float32")
            .removeprefix("torch."),
            hf_config=hf,
        )


def _rope_params(hf: Any) -> tuple[float, str, dict[str, Any] | None]:
    params = getattr(hf, "rope_parameters", None)  # transformers >= 5
    if params:
        params = dict(params)
        theta = float(params.pop("rope_theta", None) or getattr(hf, "rope_theta", 10000.0))
    else:
        theta = float(getattr(hf, "rope_theta", 10000.0))
        params = dict(getattr(hf, "rope_scaling", None) or {})
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in STATIC_ROPE_TYPES:
        raise ModelConfigError(
            f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(STATIC_ROPE_TYPES)}"
        )
    return theta, rope_type, (params or None) if rope_type != "default" else None


def _context_length(hf: Any) -> int:
    ctx = model_context_length(hf.to_dict())
    if ctx is None:
        raise ModelConfigError("config has no max_position_embeddings")
    positions = int(getattr(hf, "max_position_embeddings", 0) or 0)
    if ctx < positions:
        logger.warning("sliding_window=%d < max_position_embeddings=%d: capping the context", ctx, positions)
    return ctx


def _as_list(x: Any) -> list[int]:
    if x is None:
        return []
    if isinstance(x, (list, tuple)):
        return [int(i) for i in x]
    return [int(x)]


def _eos_token_ids(hf: Any, model_path: str) -> tuple[int, ...]:
    ids = _as_list(getattr(hf, "eos_token_id", None))
    gen = Path(model_path) / "generation_config.json"
    if gen.is_file():
        try:
            ids += _as_list(json.loads(gen.read_text()).get("eos_token_id"))
        except (ValueError, TypeError) as e:
            raise ModelConfigError(f"cannot read {gen}: {e}") from e
    return tuple(dict.fromkeys(ids))


@cache
def cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str | torch.dtype, device: torch.device | str) -> torch.dtype:
    """"auto" -> bfloat16 on CUDA and on CPUs with native bf16, float32 elsewhere."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        dev = torch.device(device)
        if dev.type == "cuda" or (dev.type == "cpu" and cpu_has_native_bf16()):
            return torch.bfloat16
        return torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]
