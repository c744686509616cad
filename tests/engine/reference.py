"""transformers as the reference: greedy continuation with no EOS stop."""

from __future__ import annotations

import functools

import torch
import transformers


@functools.lru_cache(maxsize=8)
def hf_model(path: str) -> transformers.PreTrainedModel:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def hf_greedy(path: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Memoized: the model is already cached by path (hf_model), so its output can be too."""
    return list(_hf_greedy(path, tuple(prompt), max_new_tokens))


@functools.lru_cache(maxsize=4096)
@torch.inference_mode()
def _hf_greedy(path: str, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    model = hf_model(path)
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=[],
        pad_token_id=0,
    )
    return tuple(out[0, len(prompt):].tolist())
