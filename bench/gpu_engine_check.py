"""The offline engine on a GPU, no NIXL or servers needed: greedy tokens against transformers on the
same device, and CUDA graphs against eager decode. One `RESULT {json}` line per configuration.

    python bench/gpu_engine_check.py                   # every configuration, vs transformers
    python bench/gpu_engine_check.py --padded          # batch shrinks 8 -> 1 through padded
                                                       # buckets; vs the first configuration
    python bench/gpu_engine_check.py --heads 2 --padded bf16-flashinfer-eager bf16-flashinfer

A tiny random Qwen2-layout checkpoint (head_dim 64, one KV head: GQA = --heads) is built in a
temp dir. float32 must be identical to transformers; bf16 on a random tiny model flips near-ties
(report, not a failure). `--device cpu` runs the float32 rows here (what the suite checks anyway).
Ran on an H200 on 2026-11-26 (README, CPU and GPU).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
import traceback
from typing import Any

import torch
import transformers

from common.engine import Engine
from common.model.testing import build_tiny_checkpoint

CONFIGS: dict[str, dict[str, Any]] = {
    "fp32-normal-eager": dict(dtype="float32", attention_backend="torch", disable_overlap_schedule=True,
                              disable_cuda_graph=True),
    "fp32-overlap": dict(dtype="float32", attention_backend="torch"),
    "bf16-torch": dict(dtype="bfloat16", attention_backend="torch"),
    "bf16-flashinfer-eager": dict(dtype="bfloat16", attention_backend="flashinfer", disable_overlap_schedule=True,
                                  disable_cuda_graph=True),
    "bf16-flashinfer": dict(dtype="bfloat16", attention_backend="flashinfer", cuda_graph_max_bs=16),
}
PROMPT_LENGTHS = (3, 17, 64, 100, 250, 600, 31, 900)
NEW_TOKENS = 24


@torch.inference_mode()
def hf_greedy(path: str, dtype: torch.dtype, device: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    outs = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             eos_token_id=[], pad_token_id=0)
        outs.append(out[0, len(p):].tolist())
    return outs


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--heads", type=int, default=4, help="query heads over one KV head (the GQA group)")
    ap.add_argument("--padded", action="store_true",
                    help="max_new_tokens 4, 7, 10, ...: the decode batch passes padded bucket sizes; "
                         "compare each configuration with the first")
    args = ap.parse_args()
    path = str(build_tiny_checkpoint(tempfile.mkdtemp(prefix="gpu-engine-check-"), "qwen2",
                                     hidden_size=64 * args.heads, num_heads=args.heads, num_kv_heads=1))
    vocab = json.loads(open(f"{path}/config.json").read())["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]
    budgets = [3 * i + 4 if args.padded else NEW_TOKENS for i in range(len(prompts))]
    references: dict[str, list[list[int]]] = {}
    first: list[list[int]] | None = None
    for name in args.configs:
        kw = CONFIGS[name]
        start = time.perf_counter()
        try:
            engine = Engine(path, device=args.device, page_size=16, chunked_prefill_size=256, max_total_tokens=16384, **kw)
            params = [{"max_new_tokens": b, "temperature": 0.0, "ignore_eos": True} for b in budgets]
            got = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
            engine.check_integrity()
            graphs = getattr(engine.core.runner, "decode_graphs", None) is not None
            engine.shutdown()
            if args.padded:
                first = first or got
                want, against = first, args.configs[0]
            else:
                if kw["dtype"] not in references:
                    dtype = torch.float32 if kw["dtype"] == "float32" else torch.bfloat16
                    references[kw["dtype"]] = hf_greedy(path, dtype, args.device, prompts, NEW_TOKENS)
                want, against = references[kw["dtype"]], "transformers"
            info: dict[str, Any] = {
                "config": name, "vs": against, "prompts": len(prompts),
                "identical": sum(g == w for g, w in zip(got, want, strict=True)),
                "first_divergence": [first_divergence(g, w) for g, w in zip(got, want, strict=True)],
                "cuda_graphs": graphs, "seconds": round(time.perf_counter() - start, 1),
            }
        except Exception as e:  # one configuration's failure must not hide the others'
            info = {"config": name, "error": repr(e)[:400], "traceback": traceback.format_exc()[-1500:]}
        print("RESULT " + json.dumps(info), flush=True)


if __name__ == "__main__":
    main()
