"""The grammar bitmask of one step: built by the scheduler with the step, filled by the scheduler
once every constrained row's previous token is accepted, applied by the worker to the logits
before sampling (CPU and CUDA alike: plain torch ops on the step's device).

In the overlap loop step N+1 is built before step N's tokens are known. Its mask is filled right
after the scheduler processes step N (SGLang does the same); the worker, which may already have
run N+1's forward on its own thread, waits for that before it samples. A step's mask is never
filled from a stale grammar state.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from common.grammar.matcher import RequestGrammar

FILL_WAIT_S = 120.0  # the scheduler fills within one step; past this the scheduler is gone


class GrammarMaskTimeout(RuntimeError):
    """The scheduler never filled a step's grammar mask."""


class StepGrammarMask:
    """rows: positions among the step's sampled rows (the worker's kept rows) that are constrained,
    grammars: theirs, in the same order."""

    def __init__(self, rows: list[int], grammars: list[RequestGrammar], vocab_size: int) -> None:
        self.rows = rows
        self.grammars = grammars
        self.vocab_size = vocab_size
        self.bitmask = torch.zeros((len(rows), (vocab_size + 31) // 32), dtype=torch.int32)
        self._filled = threading.Event()

    @property
    def ready(self) -> bool:
        return self._filled.is_set()

    def fill(self) -> None:
        """Scheduler thread: every row from its grammar's current state (idempotent)."""
        if self._filled.is_set():
            return
        for j, grammar in enumerate(self.grammars):
            grammar.fill(self.bitmask, j)
        self._filled.set()

    def apply(self, logits: torch.Tensor, timeout: float = FILL_WAIT_S) -> None:
        """Worker thread: -inf at every token a constrained row may not take (logits: one row per
        sampled request, in place)."""
        if not self._filled.wait(timeout):
            raise GrammarMaskTimeout(f"grammar mask of {len(self.rows)} rows not filled within {timeout:g} s")
        allowed = unpack_bitmask(self.bitmask.to(logits.device, non_blocking=True), logits.shape[-1])
        if len(self.rows) == logits.shape[0] and self.rows == list(range(len(self.rows))):
            logits.masked_fill_(~allowed, float("-inf"))
            return
        index = torch.tensor(self.rows, dtype=torch.int64).to(logits.device, non_blocking=True)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


_SHIFTS: dict[Any, torch.Tensor] = {}


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 words [rows, W] -> bool [rows, vocab_size] (bit i of word w = token 32w + i)."""
    shifts = _SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = _SHIFTS[bitmask.device] = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    out = bits.view(bitmask.shape[0], -1).bool()
    if out.shape[1] >= vocab_size:
        return out[:, :vocab_size]
    pad = torch.zeros((out.shape[0], vocab_size - out.shape[1]), dtype=torch.bool, device=out.device)
    return torch.cat([out, pad], dim=1)
