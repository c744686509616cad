"""Rotary position embedding with a cos/sin table built once for the whole context.

HF "rotate_half" convention (the checkpoints' q/k rows are laid out for it):

    x = [x1 | x2]                 (two halves of head_dim)
    out = [x1*cos - x2*sin | x2*cos + x1*sin]

Scaled variants (linear, llama3, yarn) only change the inverse frequencies and
a constant factor on cos/sin; transformers computes those for us so the
numbers match the reference exactly.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from common.model.config import ModelConfig


class RotaryEmbedding:
    """Owns a [context_length, head_dim // 2] cos and sin table on the model's device."""

    def __init__(self, config: ModelConfig, device: torch.device | str) -> None:
        inv_freq, factor = _inv_freq(config, torch.device(device))
        positions = torch.arange(config.context_length, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, inv_freq)
        self.cos = freqs.cos() * factor
        self.sin = freqs.sin() * factor
        self.context_length = config.context_length

    def table(self, positions: torch.Tensor) -> RopeTable:
        """cos/sin of this step's tokens, looked up once per forward and shared by all layers."""
        return RopeTable(self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))


class RopeTable(NamedTuple):
    cos: torch.Tensor  # [T, 1, head_dim // 2] float32
    sin: torch.Tensor

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D] -> rotated q, k (same dtype)."""
        return self._rotate(q), self._rotate(k)

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * self.cos - x2 * self.sin, x2 * self.cos + x1 * self.sin), dim=-1).to(x.dtype)


def _inv_freq(config: ModelConfig, device: torch.device) -> tuple[torch.Tensor, float]:
    if config.rope_type == "default":
        exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64).to(device, torch.float32)
        return 1.0 / (config.rope_theta ** (exponents / config.head_dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, factor = ROPE_INIT_FUNCTIONS[config.rope_type](config.hf_config, device)
    return inv_freq.to(device, torch.float32), float(factor)
