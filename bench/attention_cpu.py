"""Attention on CPU: the torch backend's SDPA call shapes.

    python bench/attention_cpu.py [--prefix 1536] [--extend 512] [--decode-batch 32]

Default model's attention shape (SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64), bf16.
1. Extend: torch's CPU SDPA runs its flash kernel only for 4-D inputs; 3-D inputs (what the
   backend passed before) take the math path. ms per call for a chunk over a prefix (bool
   mask) and a chunk without prefix (is_causal).
2. Decode through TorchAttentionBackend (one layer, pages scattered over a pool): all rows in
   one padded group (what the backend did before) vs decode_groups (length groups cut to
   cache-sized pieces), on mixed lengths 50-768 and on uniform lengths 500; and the fused C
   kernel (common/model/cpu_kernels: every row in one call, pages read in place, no gather).
Last line: RESULT {json}.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from common.cache.kv_pool import KVPool
from common.model.attention import AttentionShape, torch_backend
from common.model.forward_batch import ForwardBatch, ForwardMode


def timed(fn: Callable[[], torch.Tensor], reps: int = 10) -> float:
    for _ in range(2):
        fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def decode_ms(lengths: list[int], heads: int, kv_heads: int, head_dim: int) -> tuple[float, float, float | None, float]:
    """(one group ms, grouped ms, fused kernel ms or None without it, max |diff| of the three)
    for one decode layer over these sequence lengths."""
    page = 16
    pages_per_req = [(n + page - 1) // page for n in lengths]
    pool = KVPool(num_layers=1, num_pages=sum(pages_per_req) + 1, page_size=page, num_kv_heads=kv_heads,
                  head_dim=head_dim, dtype=torch.bfloat16, device="cpu")
    pool.kv.normal_()
    free = list(range(1, pool.num_pages))
    random.Random(0).shuffle(free)
    r2t = torch.zeros(len(lengths), max(lengths), dtype=torch.int32)
    for r, n in enumerate(lengths):
        own = [free.pop() for _ in range(pages_per_req[r])]
        r2t[r, :n] = torch.tensor([own[i // page] * page + i % page for i in range(n)], dtype=torch.int32)
    batch = ForwardBatch.build(ForwardMode.DECODE, [1] * len(lengths), [n - 1 for n in lengths],
                               [int(r2t[r, n - 1]) for r, n in enumerate(lengths)], list(range(len(lengths))),
                               lengths, [n - 1 for n in lengths])
    shape = AttentionShape(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, scaling=head_dim**-0.5)
    backend = torch_backend.TorchAttentionBackend(shape=shape, kv_pool=pool, req_to_token=r2t)
    q = torch.randn(len(lengths), heads, head_dim, dtype=torch.bfloat16)
    grouped = torch_backend.decode_groups
    kernels, backend._kernels = backend._kernels, None  # gather + SDPA first
    results = []
    for groups in (lambda n: [list(range(len(n)))], grouped):
        torch_backend.decode_groups = groups
        backend.init_forward_metadata(batch)
        results.append((timed(lambda: backend.forward(q, q, q, 0, batch), reps=20), backend.forward(q, q, q, 0, batch)))
    torch_backend.decode_groups = grouped
    if kernels is not None:
        backend._kernels = kernels
        backend.init_forward_metadata(batch)
        results.append((timed(lambda: backend.forward(q, q, q, 0, batch), reps=20), backend.forward(q, q, q, 0, batch)))
    diff = max((r[1].float() - results[0][1].float()).abs().max().item() for r in results)
    return results[0][0], results[1][0], results[2][0] if kernels is not None else None, diff


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix", type=int, default=1536)
    ap.add_argument("--extend", type=int, default=512)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--decode-batch", type=int, default=32)
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
    rng = random.Random(1)
    for name, lengths in (("mixed", [rng.randint(50, 768) for _ in range(a.decode_batch)]),
                          ("uniform", [500] * a.decode_batch)):
        one, grouped, fused, diff = decode_ms(lengths, a.heads, a.kv_heads, d)
        res[f"decode_{name}_one_group_ms"], res[f"decode_{name}_grouped_ms"] = one, grouped
        res[f"decode_{name}_speedup"] = one / grouped
        if fused is not None:
            res[f"decode_{name}_fused_ms"], res[f"decode_{name}_fused_vs_grouped"] = fused, grouped / fused
        print(f"decode {a.decode_batch} rows, {name} lengths: one group {one:.2f} ms, grouped {grouped:.2f} ms "
              f"({one / grouped:.2f}x), fused kernel {'-' if fused is None else f'{fused:.2f}'} ms; max |diff| {diff:.2e}")
    print("RESULT " + json.dumps({k2: round(v2, 4) for k2, v2 in res.items()}))


if __name__ == "__main__":
    main()
