"""A model worker without a model, for scheduler tests.

It keeps a token per KV slot and a req_to_token table, exactly as the real worker
keeps K/V tensors, and "samples" a token that is a deterministic function of the
WHOLE sequence read back through req_to_token. So if the scheduler ever gives a
request a wrong slot, a stale table row, or a wrong placeholder, its output differs
from `reference_generate` — the fake checks the bookkeeping end to end.
"""

from __future__ import annotations

import time

from common.scheduler.executor import StepResult, WorkerBatch


def next_token(seq: list[int], vocab_size: int) -> int:
    h = 1469598103934665603
    for t in seq:
        h = ((h ^ (t + 1)) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h % vocab_size


def reference_generate(prompt: list[int], max_new_tokens: int, vocab_size: int, eos: frozenset[int] = frozenset()) -> list[int]:
    seq = list(prompt)
    out: list[int] = []
    for _ in range(max_new_tokens):
        t = next_token(seq, vocab_size)
        out.append(t)
        seq.append(t)
        if t in eos:
            break
    return out


class FakeModelWorker:
    def __init__(
        self, *, vocab_size: int, num_slots: int, max_reqs: int, future_capacity: int, step_delay_s: float = 0.0
    ) -> None:
        self.vocab_size = vocab_size
        self.kv: list[int | None] = [None] * num_slots
        self.table: dict[int, list[int]] = {r: [] for r in range(max_reqs)}
        self.future = [0] * future_capacity
        self.step_delay_s = step_delay_s
        self.steps = 0

    @property
    def future_capacity(self) -> int:
        return len(self.future)

    def run(self, batch: WorkerBatch) -> StepResult:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        for w in batch.slot_writes:
            row = self.table[w.row]
            if len(row) < w.start + len(w.slots):
                row.extend([0] * (w.start + len(w.slots) - len(row)))
            row[w.start : w.start + len(w.slots)] = w.slots
        ids = [self.future[-i - 1] if i < 0 else i for i in batch.input_ids]
        for tok, loc in zip(ids, batch.out_cache_loc, strict=True):
            self.kv[loc] = tok
        out = []
        for req_row, seq_len in zip(batch.req_pool_indices, batch.seq_lens, strict=True):
            seq = [self.kv[self.table[req_row][j]] for j in range(seq_len)]
            assert all(t is not None for t in seq), "read a KV slot that was never written"
            out.append(next_token([t for t in seq if t is not None], self.vocab_size))
        for fi, tok in zip(batch.future_indices, out, strict=True):
            self.future[fi] = tok
        self.steps += 1
        return StepResult(next_token_ids=out, logprobs=[0.0] * len(out))
