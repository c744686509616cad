"""Tiny random Llama-family checkpoints for tests and demos (no hub needed).

`build_tiny_checkpoint(dir, arch)` writes a normal HF checkpoint directory
(config.json, model.safetensors, tokenizer files with a chat template) that both
transformers and our loader read. The tokenizer is a byte-level BPE trained in
memory on a small built-in corpus, so any text round-trips.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Prefill computes the prompt, decode generates one token at a time.",
    "What is the capital of France? The capital of France is Paris.",
    "KV cache pages move from prefill to decode over NIXL and UCX.",
    "Hello world! 0123456789 ,.;:!?-_()[]{}<>'\"/\\|@#$%^&*+=~`",
    "Un deux trois, naïve café, 東京, München, emoji 🙂 ok.",
] * 4

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

ARCHS = ("llama", "qwen2", "qwen3", "mistral")


def build_tiny_tokenizer(vocab_size: int = 384):  # -> PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_checkpoint(
    path: str | os.PathLike[str],
    arch: str = "llama",
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = False,
    seed: int = 0,
) -> Path:
    """Write a random checkpoint of `arch` (llama | qwen2 | qwen3 | mistral) to `path`."""
    import torch
    import transformers

    assert arch in ARCHS, f"unknown arch {arch!r}"
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer()
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config: Any
    model_cls: Any
    if arch == "llama":
        config = transformers.LlamaConfig(**common)
        model_cls = transformers.LlamaForCausalLM
    elif arch == "mistral":
        config = transformers.MistralConfig(**common, sliding_window=None)
        model_cls = transformers.MistralForCausalLM
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common)
        model_cls = transformers.Qwen2ForCausalLM
    else:
        config = transformers.Qwen3Config(**common, head_dim=hidden_size // num_heads)
        model_cls = transformers.Qwen3ForCausalLM
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    # Random init gives near-uniform logits; sharpen them so greedy ties cannot occur.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
