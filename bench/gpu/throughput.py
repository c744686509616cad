"""Offline engine decode speed on one checkpoint, next to the weight-streaming floor and (unless
--no-hf) transformers `generate` on the same device. bf16, greedy, ignore_eos.

    python bench/gpu/throughput.py MODEL [--batch 64] [--prompt 128] [--new 256] [--no-hf]

Last line: RESULT {json}: engine_tok_s (batch B), engine_b1_ms_per_tok (one request, N tokens,
its prefill included), and on CUDA read_gbs (a read-only reduction over 2 GiB: the rate a weight
stream gets), b1_floor_ms = the bytes one decode step must read (every weight but the embedding
table, from the safetensors headers) / read_gbs, and b1_vs_floor.
"""

from __future__ import annotations

import argparse
import json
import random
import struct
import time
from pathlib import Path
from typing import Any

import torch

from common.engine import Engine


def streamed_weight_bytes(path: str) -> int:
    """Bytes of every tensor in the checkpoint except the token embedding (one row is read per
    token), read from the safetensors headers without loading anything."""
    total = 0
    for f in Path(path).glob("*.safetensors"):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name != "__metadata__" and "embed_tokens" not in name:
                total += meta["data_offsets"][1] - meta["data_offsets"][0]
    return total


def read_gbs(dev: str) -> float | None:
    if dev != "cuda":
        return None
    x = torch.ones(1 << 30, dtype=torch.bfloat16, device=dev)
    for _ in range(3):
        x.sum()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        x.sum()
    torch.cuda.synchronize()
    return round(10 * 2 * x.numel() / (time.perf_counter() - t) / 1e9, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--no-hf", action="store_true", help="skip transformers generate (slow on 8B)")
    a = ap.parse_args()
    B, P, N, path = a.batch, a.prompt, a.new, a.model
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    vocab = json.loads(Path(path, "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(P)] for _ in range(B)]
    res: dict[str, Any] = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "batch": B,
                           "prompt": P, "new": N, "read_gbs": read_gbs(dev)}

    def timed(fn: Any) -> tuple[Any, float]:
        sync()
        t = time.perf_counter()
        out = fn()
        sync()
        return out, time.perf_counter() - t

    kw: dict[str, Any] = dict(device=dev, dtype="bfloat16", page_size=16, max_total_tokens=B * (P + N) + 4096,
                              max_running_requests=max(B, 8), chunked_prefill_size=8192)
    if dev == "cuda":
        kw.update(attention_backend="flashinfer", cuda_graph_max_bs=max(B, 8))
    eng_ids = run_engine(path, kw, prompts, N, res, timed)
    wbytes = streamed_weight_bytes(path)
    res["streamed_weight_gb"] = round(wbytes / 1e9, 3)
    if res["read_gbs"]:
        floor_ms = wbytes / (res["read_gbs"] * 1e9) * 1000
        res["b1_floor_ms"] = round(floor_ms, 3)
        res["b1_vs_floor"] = round(res["engine_b1_ms_per_tok"] / floor_ms, 2)
    if not a.no_hf:
        res.update(hf_compare(path, dev, prompts, N, eng_ids, res, timed))
    print("RESULT " + json.dumps(res), flush=True)


def run_engine(path: str, kw: dict[str, Any], prompts: list[list[int]], N: int, res: dict[str, Any],
               timed: Any) -> list[list[int]]:
    """Batch B then batch 1 through the offline engine (warmed up first); adds to `res`."""
    B = len(prompts)
    t0 = time.perf_counter()
    eng = Engine(path, **kw)
    res["engine_load_s"] = round(time.perf_counter() - t0, 1)
    sp = lambda n: {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}  # noqa: E731
    try:
        eng.generate(input_ids=prompts[:8], sampling_params=[sp(16)] * len(prompts[:8]))
        eng.generate(input_ids=prompts, sampling_params=[sp(8)] * B)
        out, dt = timed(lambda: eng.generate(input_ids=prompts, sampling_params=[sp(N)] * B))
        assert all(len(o["output_ids"]) == N for o in out)
        res["engine_tok_s"] = round(B * N / dt, 1)
        res["engine_ms_per_step"] = round(1000 * dt / N, 3)
        _, dt1 = timed(lambda: eng.generate(input_ids=prompts[0], sampling_params=sp(N)))
        res["engine_b1_ms_per_tok"] = round(1000 * dt1 / N, 3)
        eng.check_integrity()
    finally:
        eng.shutdown()
    return [o["output_ids"] for o in out]


def hf_compare(path: str, dev: str, prompts: list[list[int]], N: int, eng_ids: list[list[int]],
               res: dict[str, Any], timed: Any) -> dict[str, Any]:
    import transformers

    if dev == "cuda":
        torch.cuda.empty_cache()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(dev).eval()
    ids = torch.tensor(prompts, device=dev)
    B, P = ids.shape

    def g(x: torch.Tensor, n: int) -> torch.Tensor:
        return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, eos_token_id=None, pad_token_id=0)

    out: dict[str, Any] = {}
    with torch.inference_mode():
        g(ids[:8], 8)
        g(ids, 8)
        hf, dt = timed(lambda: g(ids, N))
        out["hf_static_tok_s"] = round(B * N / dt, 1)
        _, dt1 = timed(lambda: g(ids[:1], N))
        out["hf_b1_ms_per_tok"] = round(1000 * dt1 / N, 3)
    hf_ids = hf[:, P:].tolist()
    out["greedy_equal_first32"] = sum(a[:32] == b[:32] for a, b in zip(eng_ids, hf_ids, strict=True)) / B
    out["ratio_vs_hf_static"] = round(res["engine_tok_s"] / out["hf_static_tok_s"], 2)
    out["b1_ratio_vs_hf"] = round(out["hf_b1_ms_per_tok"] / res["engine_b1_ms_per_tok"], 2)
    return out


if __name__ == "__main__":
    main()
