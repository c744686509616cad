"""A hand-driven 'scheduler' for model tests: scattered pages, req_to_token rows, ForwardBatches.

Each request gets a req_to_token row; its tokens go to pages drawn at random from
the pool (so no two neighbouring pages are contiguous), page_size tokens per page:

    token i of a request -> slot = pages[i // page_size] * page_size + i % page_size
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from common.model.config import ModelConfig
from common.model.forward_batch import ForwardBatch, ForwardMode
from common.model.model_runner import ModelRunner
from common.model.sampler import Sampler, SamplingBatchInfo
from common.sampling_params import SamplingParams


@dataclass
class _Seq:
    row: int
    tokens: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)


class PagedHarness:
    def __init__(
        self,
        model_path: str,
        *,
        page_size: int,
        dtype: str = "float32",
        max_reqs: int = 8,
        max_context: int = 256,
        attention_backend: str = "torch",
        seed: int = 0,
        device: str | torch.device = "cpu",
        quantization: str | None = None,
    ) -> None:
        config = ModelConfig.from_pretrained(model_path)
        self.device = torch.device(device)
        self.page_size = page_size
        self.pool = ModelRunner.create_kv_pool(
            config, max_total_tokens=max_reqs * max_context * 2, page_size=page_size, dtype=dtype, device=self.device
        )
        self.req_to_token = torch.zeros(max_reqs, max_context, dtype=torch.int32, device=self.device)
        self.runner = ModelRunner(
            model_path,
            dtype=dtype,
            device=self.device,
            kv_pool=self.pool,
            req_to_token=self.req_to_token,
            attention_backend=attention_backend,
            quantization=quantization,
        )
        self.free_pages = list(range(1, self.pool.num_pages))
        random.Random(seed).shuffle(self.free_pages)
        self.seqs: dict[str, _Seq] = {}
        self.free_rows = list(range(max_reqs))[::-1]

    def seq(self, name: str) -> list[int]:
        return self.seqs[name].tokens

    def _append(self, name: str, new: list[int]) -> tuple[int, list[int], list[int]]:
        """Add tokens to `name` (new request if unknown) -> (prefix_len, positions, slots)."""
        if name not in self.seqs:
            self.seqs[name] = _Seq(row=self.free_rows.pop())
        s = self.seqs[name]
        prefix = len(s.tokens)
        slots = []
        for i in range(prefix, prefix + len(new)):
            if i // self.page_size == len(s.pages):
                s.pages.append(self.free_pages.pop())
            slot = s.pages[i // self.page_size] * self.page_size + i % self.page_size
            self.req_to_token[s.row, i] = slot
            slots.append(slot)
        s.tokens.extend(new)
        return prefix, list(range(prefix, prefix + len(new))), slots

    def batch(self, mode: ForwardMode, steps: list[tuple[str, list[int]]]) -> ForwardBatch:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        rows, seq_lens, prefix_lens = [], [], []
        for name, new in steps:
            prefix, pos, sl = self._append(name, new)
            ids += new
            positions += pos
            slots += sl
            rows.append(self.seqs[name].row)
            prefix_lens.append(prefix)
            seq_lens.append(prefix + len(new))
        return ForwardBatch.build(mode, ids, positions, slots, rows, seq_lens, prefix_lens, device=self.device)

    def step(self, mode: ForwardMode, steps: list[tuple[str, list[int]]]) -> torch.Tensor:
        """Run one step; float32 logits of EVERY new token [num_tokens, vocab]."""
        hidden = self.runner.forward_hidden(self.batch(mode, steps), all_tokens=True)
        return self.runner.compute_logits(hidden)

    def step_last(self, mode: ForwardMode, steps: list[tuple[str, list[int]]]) -> torch.Tensor:
        """Run one step through ModelRunner.forward: logits of each request's last token."""
        return self.runner.forward(self.batch(mode, steps))


def greedy_batched(h: PagedHarness, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """All prompts in one EXTEND batch, then max_new - 1 batched DECODE steps (greedy, via Sampler)."""
    sampler = Sampler(h.runner.vocab_size, max_rows=8)
    names = [f"r{i}" for i in range(len(prompts))]
    greedy = SamplingParams(temperature=0.0)
    logits = h.step_last(ForwardMode.EXTEND, list(zip(names, prompts, strict=True)))
    row_ids = [h.seqs[n].row for n in names]
    for r, p in zip(row_ids, prompts, strict=True):
        sampler.reset_row(r, p)
    info = SamplingBatchInfo.from_params([greedy] * len(names), row_ids, vocab_size=h.runner.vocab_size)
    outs = [[t] for t in sampler.sample(logits, info).next_token_ids.tolist()]
    for _ in range(max_new - 1):
        logits = h.step_last(ForwardMode.DECODE, [(n, [o[-1]]) for n, o in zip(names, outs, strict=True)])
        for o, t in zip(outs, sampler.sample(logits, info).next_token_ids.tolist(), strict=True):
            o.append(t)
    return outs


def truncate_at_eos(ids: list[int], eos: tuple[int, ...]) -> list[int]:
    for i, t in enumerate(ids):
        if t in eos:
            return ids[: i + 1]
    return ids


def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """transformers' logits for every position of one sequence [len, vocab]."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def load_hf(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
