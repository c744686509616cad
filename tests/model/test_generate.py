"""A greedy loop driven by hand through ModelRunner + Sampler == transformers `generate`."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from tests.model.harness import PagedHarness, greedy_batched, load_hf, truncate_at_eos

TEXTS = [
    "The quick brown fox",
    "What is the capital of France?",
    "Hello",
    "Prefill computes the prompt, decode generates one token at a time. KV cache pages move",
]


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
