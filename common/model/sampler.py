"""Turns logits into next tokens: penalties, temperature, top-k / top-p / min-p, seeds, logprobs.

Who owns what: the Sampler owns per-row state that outlives a batch, keyed by
sampler row (the request's req_to_token row):
  - output token counts and a prompt-token mask (penalties),
  - the number of tokens sampled so far (the step of seeded noise).
The scheduler calls `reset_row` when it gives a row to a request; after that
the sampler updates the state with every token it samples, so the state is
right even when the scheduler runs a step ahead (overlap loop). Only pass rows
whose sampled token will be kept (not intermediate chunks of a chunked prefill).

Pipeline per batch (row-wise parameters):

    logits -> repetition (prompt+output, HF) -> frequency/presence (output, OpenAI)
           -> greedy rows: argmax
           -> other rows: softmax(logits / T) -> top-k -> top-p (renormalised) -> min-p
                          -> argmax(probs / Exp(1) noise)   (== a categorical draw)

Seeded rows draw their noise from a generator seeded by (seed, step), so the same
seed yields the same tokens whatever else shares the batch. Logprobs are those of
the model's raw distribution: log_softmax(logits) before penalties and temperature.
Stop tokens, EOS and max_new_tokens are the scheduler's business.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from common.model.device_streams import DeviceStreams, HostStreams
from common.model.sampling_info import SamplingBatchInfo

__all__ = ["SampleOutput", "Sampler", "SamplingBatchInfo", "TopLogprobs"]

_MASK64 = (1 << 64) - 1


class TopLogprobs(NamedTuple):
    values: torch.Tensor  # [bs, k] float32, k = max requested; row i uses its first top_logprobs_nums[i]
    token_ids: torch.Tensor  # [bs, k] int64


class SampleOutput(NamedTuple):
    next_token_ids: torch.Tensor  # [bs] int64
    logprobs: torch.Tensor | None  # [bs] float32 logprob of each chosen token, when asked for
    top_logprobs: TopLogprobs | None


class Sampler:
    def __init__(
        self, vocab_size: int, max_rows: int, device: torch.device | str = "cpu", streams: DeviceStreams | None = None
    ) -> None:
        self.vocab_size = vocab_size
        self.max_rows = max_rows
        self.device = torch.device(device)
        self.streams = streams or HostStreams(self.device)
        self._steps = [0] * max_rows
        # Penalty state is allocated on first use ([max_rows, vocab] each); until then resets are recorded.
        self._counts: torch.Tensor | None = None
        self._prompt_mask: torch.Tensor | None = None
        self._pending: dict[int, tuple[list[int], list[int]]] = {}

    def reset_row(self, row: int, prompt_ids: Sequence[int], output_ids: Sequence[int] = ()) -> None:
        """Give `row` to a request whose prompt is `prompt_ids` and which has already produced
        `output_ids` (e.g. the first token sampled by a prefill instance, or a restored retraction)."""
        if not 0 <= row < self.max_rows:
            raise IndexError(f"sampler row {row} outside [0, {self.max_rows})")
        self._steps[row] = len(output_ids)
        if self._counts is None:
            self._pending[row] = (list(prompt_ids), list(output_ids))
        else:
            self._write_row(row, prompt_ids, output_ids)

    def _write_row(self, row: int, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        assert self._counts is not None and self._prompt_mask is not None
        prompt, out = self.streams.stage([prompt_ids, output_ids], torch.int64)
        self._prompt_mask[row].zero_()
        self._prompt_mask[row, prompt] = True
        self._counts[row].zero_()
        self._counts[row].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))

    def _ensure_penalty_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._counts is None or self._prompt_mask is None:
            shape = (self.max_rows, self.vocab_size)
            self._counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self._prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
            for row, (prompt, output) in self._pending.items():
                self._write_row(row, prompt, output)
            self._pending.clear()
        return self._counts, self._prompt_mask

    def sample(self, logits: torch.Tensor, info: SamplingBatchInfo) -> SampleOutput:
        """logits: [bs, vocab] float32 (row i = request i of `info`)."""
        if logits.shape != (info.batch_size, self.vocab_size):
            raise ValueError(f"logits {tuple(logits.shape)} != ({info.batch_size}, {self.vocab_size})")
        if info.rows_cpu and not 0 <= min(info.rows_cpu) <= max(info.rows_cpu) < self.max_rows:
            raise IndexError(f"sampler rows {info.rows_cpu} outside [0, {self.max_rows})")
        raw = logits.float()
        logits = self.apply_penalties(raw, info) if info.has_penalties else raw
        if info.is_all_greedy:
            next_ids = logits.argmax(dim=-1)
        else:
            next_ids = torch.where(info.greedy, logits.argmax(dim=-1), self._draw(logits, info))
        if self._counts is not None:
            self._counts[info.rows, next_ids] += 1
        for row in info.rows_cpu:
            self._steps[row] += 1
        return self._logprobs(raw, next_ids, info)

    def apply_penalties(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """The penalised logits of this batch (state is read, not updated)."""
        counts_all, prompt_all = self._ensure_penalty_state()
        counts = counts_all[info.rows]
        if info.has_repetition_penalty:
            seen = prompt_all[info.rows] | (counts > 0)
            rep = info.repetition_penalties[:, None]
            logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        return (
            logits
            - info.frequency_penalties[:, None] * counts
            - info.presence_penalties[:, None] * (counts > 0).to(logits.dtype)
        )

    def _draw(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        probs = torch.softmax(logits / info.temperatures, dim=-1)
        if not (info.need_top_k or info.need_top_p):
            if info.need_min_p:
                probs = probs.masked_fill(probs < info.min_ps[:, None] * probs.amax(-1, keepdim=True), 0.0)
            return (probs / self._noise(info, None)).argmax(dim=-1)
        probs, order = self._rank(probs, info)
        if info.need_top_k:
            ranks = torch.arange(probs.shape[1], device=probs.device)[None, :]
            probs = probs.masked_fill(ranks >= info.top_ks[:, None], 0.0)
        if info.need_top_p:
            # top-p over the distribution renormalised after top-k (mass 1 when top-k is off)
            mass = torch.where(info.top_ks < self.vocab_size, probs.sum(-1), 1.0)[:, None]
            before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
            probs = probs.masked_fill(before > info.top_ps[:, None] * mass, 0.0)
        if info.need_min_p:
            probs = probs.masked_fill(probs < info.min_ps[:, None] * probs[:, :1], 0.0)
        choice = (probs / self._noise(info, order)).argmax(dim=-1, keepdim=True)
        return order.gather(1, choice).squeeze(1)

    def _rank(self, probs: torch.Tensor, info: SamplingBatchInfo) -> tuple[torch.Tensor, torch.Tensor]:
        """The candidate tokens in descending probability: (probs [bs, k], token ids [bs, k])."""
        if info.candidate_k < self.vocab_size:
            top, order = probs.topk(info.candidate_k, dim=-1)
            if not info.check_candidate_mass:
                return top, order
            free = info.top_ks >= self.vocab_size
            covered = info.greedy | ~free | (top.sum(-1) >= info.top_ps)
            if bool(covered.all()):
                return top, order
        return probs.sort(dim=-1, descending=True)

    def _noise(self, info: SamplingBatchInfo, order: torch.Tensor | None) -> torch.Tensor:
        """Exp(1) noise for each candidate token ([bs, vocab], or aligned with `order` [bs, k]).
        A seeded row's noise is a function of (seed, step, token id) only."""
        width = self.vocab_size if order is None else order.shape[1]
        noise = torch.empty(info.batch_size, width, device=self.device)
        if any(s is None for s in info.seeds):
            noise.exponential_()
        for i, seed in enumerate(info.seeds):
            if seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(_mix(seed, self._steps[info.rows_cpu[i]]))
                row = torch.empty(self.vocab_size, device=self.device).exponential_(generator=gen)
                noise[i] = row if order is None else row[order[i]]
        return noise

    def _logprobs(self, raw: torch.Tensor, next_ids: torch.Tensor, info: SamplingBatchInfo) -> SampleOutput:
        if not info.return_logprob:
            return SampleOutput(next_ids, None, None)
        logprobs = torch.log_softmax(raw, dim=-1)
        chosen = logprobs.gather(1, next_ids[:, None]).squeeze(1)
        top = None
        if info.max_top_logprobs > 0:
            values, ids = logprobs.topk(info.max_top_logprobs, dim=-1)
            top = TopLogprobs(values, ids)
        return SampleOutput(next_ids, chosen, top)


def _mix(seed: int, step: int) -> int:
    """splitmix64 of (seed, step) -> a 63-bit generator seed."""
    x = (seed * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1
