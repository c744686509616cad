"""config.json read as it is, when that gives what transformers.AutoConfig would.

AutoConfig costs ~1.5 s of CPU per engine start (its config classes import
torch.distributed.tensor and sympy). For the four supported layouts a checkpoint's
config.json normally names every field the native model reads; then the file itself is
the config. Anything AutoConfig would fill from a class default (a missing key), a rope type
whose frequencies come from transformers, or a nested text_config sends the caller back to
AutoConfig. tests/model/test_plain_config.py checks both give the same ModelConfig.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common.model.context_length import read_config_json

# Keys whose class defaults differ between layouts or matter to the native model: they must
# be in the file. Keys left out default the same way in all four classes (hidden_act "silu",
# attention_bias / mlp_bias False, head_dim hidden_size / heads except for qwen3).
REQUIRED_KEYS = (
    "model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "vocab_size", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
    "eos_token_id",
)
REQUIRED_BY_LAYOUT = {"qwen3": ("head_dim",), "mistral": ("sliding_window",), "qwen2": ("use_sliding_window",)}
PLAIN_LAYOUTS = ("llama", "mistral", "qwen2", "qwen3")


class PlainConfig:
    """The config.json dict with attribute access, as ModelConfig.from_hf_config reads it."""

    def __init__(self, raw: dict[str, Any]) -> None:
        self._raw = raw

    def __getattr__(self, name: str) -> Any:
        try:
            return self._raw[name]
        except KeyError:
            raise AttributeError(name) from None

    def to_dict(self) -> dict[str, Any]:
        return dict(self._raw)


def _default_rope(raw: dict[str, Any]) -> bool:
    params = raw.get("rope_parameters")
    if isinstance(params, dict):
        return params.get("rope_type", params.get("type", "default")) == "default" and "rope_theta" in params
    scaling = raw.get("rope_scaling")
    return scaling is None and "rope_theta" in raw


def read_plain_config(model_path: str | Path) -> PlainConfig | None:
    """PlainConfig when config.json alone describes the model; None: use AutoConfig."""
    raw = read_config_json(model_path)
    if "text_config" in raw or raw.get("model_type") not in PLAIN_LAYOUTS:
        return None
    needed = REQUIRED_KEYS + REQUIRED_BY_LAYOUT.get(raw["model_type"], ())
    if any(k not in raw for k in needed) or not _default_rope(raw):
        return None
    return PlainConfig(raw)
