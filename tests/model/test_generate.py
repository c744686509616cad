"""A greedy loop driven by hand through ModelRunner + Sampler == transformers `generate`."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from common.model.forward_batch import ForwardMode
from common.model.sampler import Sampler, SamplingBatchInfo
from common.sampling_params import SamplingParams
from tests.model.harness import PagedHarness, load_hf

TEXTS = [
    "The quick brown fox",
    "What is the capital of France?",
    "Hello",
    "Prefill computes the prompt, decode generates one token at a time. KV cache pages move",
]


def greedy_batched(h: PagedHarness, prompts: list[list[int]], max_new: int) -> list[list[int]]:
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


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_matches_generate(tiny_checkpoint, arch: str, page_size: int) -> None:
    path = tiny_checkpoint(arch)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    max_new = 24
    h = PagedHarness(path, page_size=page_size)
    ours = greedy_batched(h, prompts, max_new)
    eos = h.runner.model_config.eos_token_ids
    ref = load_hf(path)
    lengths = []
    for p, o in zip(prompts, ours, strict=True):
        with torch.no_grad():
            out = ref.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False)
        want = out[0, len(p) :].tolist()
        assert truncate_at_eos(o, eos) == want
        lengths.append(len(want))
    assert max(lengths) >= 10, "reference stopped too early to be a meaningful comparison"
