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
        self.cos_sin_cache = torch.cat((self.cos, self.sin), dim=-1)  # [context, head_dim]: fused kernels
        self.context_length = config.context_length

    def table(self, positions: torch.Tensor) -> RopeTable:
        """cos/sin of this step's tokens, looked up once per forward and shared by all layers, laid
        out so that a rotation is x * cos + roll(x) * sin (4 ops per tensor instead of 9)."""
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        return RopeTable(torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1), positions, self.cos_sin_cache)


class RopeTable(NamedTuple):
    cos: torch.Tensor  # [T, 1, head_dim] float32: [cos | cos]
    sin: torch.Tensor  # [T, 1, head_dim] float32: [-sin | sin]
    positions: torch.Tensor  # [T]: for a fused kernel that looks the table up itself
    cos_sin_cache: torch.Tensor  # [context, head_dim] float32: [cos | sin] of every position

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D] -> rotated q, k (same dtype)."""
        return self._rotate(q), self._rotate(k)

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        """[x1*cos - x2*sin | x2*cos + x1*sin] in fp32, bit for bit: roll(x) = [x2 | x1], and
        x1*cos + x2*(-sin) rounds exactly as x1*cos - x2*sin."""
        xf = x if x.dtype == torch.float32 else x.float()
        out = xf * self.cos + xf.roll(x.shape[-1] // 2, dims=-1) * self.sin
        return out if x.dtype == torch.float32 else out.to(x.dtype)


def _inv_freq(config: ModelConfig, device: torch.device) -> tuple[torch.Tensor, float]:
    if config.rope_type == "default":
        exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64).to(device, torch.float32)
        return 1.0 / (config.rope_theta ** (exponents / config.head_dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, factor = ROPE_INIT_FUNCTIONS[config.rope_type](config.hf_config, device)
    return inv_freq.to(device, torch.float32), float(factor)
