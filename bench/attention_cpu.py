"""Extend attention on CPU: the torch backend's SDPA call shapes, 3-D vs 4-D inputs.

    python bench/attention_cpu.py [--prefix 1536] [--extend 512]

Default model's attention shape (SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64),
bf16. torch's CPU SDPA runs its flash kernel only for 4-D inputs; 3-D inputs (what the
backend passed before) take the math path. Prints ms per call for a chunk over a prefix
(bool mask) and a chunk without prefix (is_causal). Last line: RESULT {json}.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F


def timed(fn: Callable[[], torch.Tensor], reps: int = 10) -> float:
    for _ in range(2):
        fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix", type=int, default=1536)
    ap.add_argument("--extend", type=int, default=512)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    a = ap.parse_args()
    torch.manual_seed(0)
    e, p, d = a.extend, a.prefix, a.head_dim
    s = p + e
    q = torch.randn(a.heads, e, d, dtype=torch.bfloat16)
    k = torch.randn(a.kv_heads, s, d, dtype=torch.bfloat16)
    v = torch.randn(a.kv_heads, s, d, dtype=torch.bfloat16)
    mask = torch.arange(s)[None, :] <= (p + torch.arange(e))[:, None]
    scale = d**-0.5

    def sdpa(qq: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
        return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=m, is_causal=m is None, scale=scale, enable_gqa=True)

    out3 = sdpa(q, k, v, mask)
    out4 = sdpa(q[None], k[None], v[None], mask)[0]
    max_diff = (out3.float() - out4.float()).abs().max().item()
    kc, vc = k[:, p:].contiguous(), v[:, p:].contiguous()
    res = {
        "prefix_3d_ms": timed(lambda: sdpa(q, k, v, mask)),
        "prefix_4d_ms": timed(lambda: sdpa(q[None], k[None], v[None], mask)),
        "causal_3d_ms": timed(lambda: sdpa(q, kc, vc, None)),
        "causal_4d_ms": timed(lambda: sdpa(q[None], kc[None], vc[None], None)),
        "max_abs_diff": max_diff,
    }
    res["speedup_prefix"] = res["prefix_3d_ms"] / res["prefix_4d_ms"]
    res["speedup_causal"] = res["causal_3d_ms"] / res["causal_4d_ms"]
    print(f"chunk {e} over prefix {p}: 3-D {res['prefix_3d_ms']:.2f} ms, 4-D {res['prefix_4d_ms']:.2f} ms "
          f"({res['speedup_prefix']:.2f}x); no prefix: 3-D {res['causal_3d_ms']:.2f} ms, 4-D {res['causal_4d_ms']:.2f} ms "
          f"({res['speedup_causal']:.2f}x); max |diff| {max_diff:.2e}")
    print("RESULT " + json.dumps({k2: round(v2, 4) for k2, v2 in res.items()}))


if __name__ == "__main__":
    main()
