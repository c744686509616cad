"""new_token_ratio: how much of each running request's remaining budget admission reserves.

Starts at init (0.7 x schedule_conservativeness), decays linearly to init x 0.14
over `decay_steps` decode steps, resets to init when the engine goes idle, and
after a retraction jumps to min(1, (sum output + retract_steps x kept) /
(sum max_new_tokens + 1)) over the requests that stayed.
"""

from __future__ import annotations

from collections.abc import Sequence


class NewTokenRatioTracker:
    def __init__(self, *, init: float, min_factor: float, decay_steps: int, retract_steps: int) -> None:
        self.init = min(1.0, init)
        self.min = self.init * min_factor
        self.decay_per_step = (self.init - self.min) / max(1, decay_steps)
        self.retract_steps = retract_steps
        self.value = self.init

    def on_decode_step(self) -> None:
        self.value = max(self.min, self.value - self.decay_per_step)

    def on_idle(self) -> None:
        self.value = self.init

    def on_retract(self, kept_output_lens: Sequence[int], kept_max_new_tokens: Sequence[int]) -> None:
        total_out = sum(kept_output_lens)
        total_max = sum(kept_max_new_tokens)
        self.value = min(1.0, (total_out + self.retract_steps * len(kept_output_lens)) / (total_max + 1))
