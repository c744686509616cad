"""Greedy agreement on one checkpoint (CUDA): transformers fp32 (the reference) and bf16, the
engine fp32 (torch attention) and bf16 (flashinfer), the same random-token prompts each.

    python bench/gpu/agree.py MODEL [n_prompts] [new]      -> RESULT {json}

Per run against hf_fp32: `full` (fraction of prompts with every token equal), `first_token`,
`mean_common_prefix` (tokens); engine fp32 must be 16/16 (full 1.0). `bf16_engine_vs_hf_bf16`:
the engine's bf16 against transformers' bf16 (how far two bf16 implementations drift apart).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import torch

from common.engine import Engine


def hf_greedy(path: str, dtype: torch.dtype, prompts: list[list[int]], new: int) -> list[list[int]]:
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            o = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(o[0, len(p):].tolist())
    del m
    torch.cuda.empty_cache()
    return outs


def engine_greedy(path: str, prompts: list[list[int]], new: int, **kw: Any) -> list[list[int]]:
    e = Engine(path, device="cuda", page_size=16, max_total_tokens=32768, **kw)
    try:
        sp = [{"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}] * len(prompts)
        outs = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=sp)]
    finally:
        e.shutdown()
    torch.cuda.empty_cache()
    return outs


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    n, new = len(a), len(a[0])
    full = sum(x == y for x, y in zip(a, b, strict=True)) / n
    first = sum(x[0] == y[0] for x, y in zip(a, b, strict=True)) / n
    pref = sum(next((i for i, (u, v) in enumerate(zip(x, y, strict=True)) if u != v), new)
               for x, y in zip(a, b, strict=True)) / n
    return {"full": round(full, 3), "first_token": round(first, 3), "mean_common_prefix": round(pref, 1)}


def main() -> None:
    path = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    new = int(sys.argv[3]) if len(sys.argv) > 3 else 32
    vocab = json.loads(Path(path, "config.json").read_text())["vocab_size"]
    rng = random.Random(1)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.choice([5, 40, 130, 300]))] for _ in range(n)]
    runs = {"hf_fp32": hf_greedy(path, torch.float32, prompts, new),
            "hf_bf16": hf_greedy(path, torch.bfloat16, prompts, new),
            "eng_fp32_torch": engine_greedy(path, prompts, new, dtype="float32", attention_backend="torch"),
            "eng_bf16_flashinfer": engine_greedy(path, prompts, new, dtype="bfloat16", attention_backend="flashinfer")}
    ref = runs["hf_fp32"]
    result: dict[str, Any] = {k: agreement(v, ref) for k, v in runs.items() if k != "hf_fp32"}
    result["bf16_engine_vs_hf_bf16"] = agreement(runs["eng_bf16_flashinfer"], runs["hf_bf16"])
    result["prompts"], result["new_tokens"] = n, new
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
