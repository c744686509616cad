"""A random Llama-shaped bf16 checkpoint, built on the GPU host itself, with the project's tiny
BPE tokenizer (vocab 384).

    python bench/gpu/gen_model.py OUT [1b|8b|tiny]        -> last line: "model OUT: ... params ..."

Shapes: `1b` = Llama-3.2-1B (16 layers, hidden 2048, 32 q / 8 KV heads, head_dim 64, MLP 8192),
`8b` = Llama-3.1-8B (32 layers, hidden 4096, 32 q / 8 KV heads, head_dim 128, MLP 14336), `tiny`
= the SMOKE model for a CPU try. Every layer weight has the real shape, so the decode step reads
what the real model's layers read; only the vocabulary is small (384 instead of 128,256): the
real 8B's embedding + lm_head add 2.1 GB (its lm_head, 1.05 GB read per token, is not in our
weight-streaming floor: the real floor is 7.5% higher). Weights are drawn with N(0, 0.08) directly in bf16 on the device
(cuda when there is one), then written as safetensors.
"""

from __future__ import annotations

import sys
import time
from typing import NamedTuple


class Shape(NamedTuple):
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    head_dim: int


SHAPES = {
    "1b": Shape(16, 2048, 32, 8, 8192, 64),
    "8b": Shape(32, 4096, 32, 8, 14336, 128),
    "tiny": Shape(2, 64, 4, 2, 128, 16),
}
VOCAB = 384  # len(build_tiny_tokenizer())


def param_count(shape: Shape, vocab: int = VOCAB) -> int:
    """Parameters of LlamaForCausalLM with untied embeddings, from the shape alone."""
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    attn = h * shape.heads * shape.head_dim * 2 + h * kv * 2  # q, o; k, v
    mlp = 3 * h * shape.intermediate
    per_layer = attn + mlp + 2 * h  # two RMSNorm weights
    return shape.layers * per_layer + 2 * vocab * h + h  # + embed, lm_head, final norm


def layer_weight_bytes(shape: Shape, bytes_per_param: int = 2) -> int:
    """The bytes a decode step streams through the layers (embeddings excluded)."""
    return (param_count(shape, vocab=0) - shape.hidden) * bytes_per_param


def llama_config(shape: Shape, tok: object) -> object:
    import transformers

    return transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=shape.hidden, intermediate_size=shape.intermediate,  # type: ignore[arg-type]
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=500000.0,
        tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,  # type: ignore[attr-defined]
        pad_token_id=tok.pad_token_id, torch_dtype="bfloat16")  # type: ignore[attr-defined]


def main(out: str, name: str) -> None:
    import torch
    import transformers

    from common.model.testing import build_tiny_tokenizer

    shape = SHAPES[name]
    t0 = time.perf_counter()
    tok = build_tiny_tokenizer()
    cfg = llama_config(shape, tok)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)  # built in bf16 directly: no fp32 copy of 8B weights
    with torch.device(dev):
        model = transformers.LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    if dev == "cuda":
        torch.cuda.synchronize()
    t_built = time.perf_counter()
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    assert n == param_count(shape, len(tok)), (n, param_count(shape, len(tok)))
    print(f"model {out}: shape {name}, {n:,} params ({n / 1e9:.3f} B), {dtype} {n * p.element_size() / 1e9:.2f} GB, "
          f"vocab {len(tok)}, built on {dev} in {t_built - t0:.1f} s, saved in {time.perf_counter() - t_built:.1f} s")


if __name__ == "__main__":
    if len(sys.argv) < 2 or (len(sys.argv) > 2 and sys.argv[2] not in SHAPES):
        sys.exit(f"usage: gen_model.py OUT [{'|'.join(SHAPES)}]")
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "1b")
