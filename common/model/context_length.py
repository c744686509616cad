"""The context length of a checkpoint, resolved one way for the router, the frontend and the engine.

    resolve_context_length(config_json_dict, requested=None) -> int

The model's own limit is its max position count (max_position_embeddings or an older
layout's key, in the text sub-config for multimodal layouts), capped by a sliding window when
the model uses one: full attention equals sliding-window attention only while no sequence
outgrows the window. A requested (--context-length) value may lower the limit, never raise it.
Torch-free: the router imports it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

POSITION_KEYS = ("max_position_embeddings", "max_sequence_length", "n_positions", "max_seq_len", "seq_length", "n_ctx")
# Layouts whose HF config class defaults use_sliding_window to False (the key may be absent).
SLIDING_WINDOW_OFF_BY_DEFAULT = ("qwen2", "qwen3")


class ContextLengthError(ValueError):
    pass


def _scopes(config: dict[str, Any]) -> list[dict[str, Any]]:
    text = config.get("text_config")
    return [text, config] if isinstance(text, dict) else [config]


def model_context_length(config: dict[str, Any]) -> int | None:
    """The checkpoint's own context limit from its config.json dict, None when it names none."""
    for scope in _scopes(config):
        positions = next((scope[k] for k in POSITION_KEYS if isinstance(scope.get(k), int) and scope[k] > 0), None)
        if positions is None:
            continue
        window = scope.get("sliding_window")
        uses_window = scope.get("use_sliding_window", scope.get("model_type") not in SLIDING_WINDOW_OFF_BY_DEFAULT)
        if isinstance(window, int) and window > 0 and uses_window and window < positions:
            return window
        return int(positions)
    return None


def resolve_context_length(config: dict[str, Any], requested: int | None = None) -> int:
    model = model_context_length(config)
    if model is None:
        if requested is None:
            raise ContextLengthError("cannot find the model's context length in config.json; pass --context-length")
        return requested
    return min(requested, model) if requested else model


def read_config_json(model_path: str | Path | None) -> dict[str, Any]:
    """config.json of a checkpoint directory as a dict ({} when there is none)."""
    if model_path is None:
        return {}
    path = Path(model_path) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}
