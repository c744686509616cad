"""Offline engine speed on this CPU, as ratios measured in one run (default model, greedy, ignore_eos).

    python bench/engine.py --quick     # ~2-3 min on a 2-core box
    python bench/engine.py             # full sizes, < 10 min on a 2-core box
    python bench/engine.py --dtype bfloat16

dtype: "auto" = bfloat16 only where the CPU has native bf16 (avx512_bf16 / amx_bf16), else
float32 (emulated bf16 runs ~3x slower on an AVX2-only EPYC). Rounds of A and B alternate
and each side keeps its best, so load from elsewhere on a shared box hits both alike.

  1. uniform: N prompts (32-96 tokens) x 64 new tokens: the engine vs transformers
     `generate` on one static batch of the same prompts      -> uniform_ratio_vs_hf
  2. batch 1: one 64-token prompt x 128 new tokens: the engine vs transformers batch 1
                                                              -> b1_ratio_vs_hf
     and the engine's seconds per token / the weight-streaming floor (weight bytes per token
     / read bandwidth measured here)                          -> b1_vs_bandwidth_floor (>= 1)
     with --torch-compile, the same through engines with --enable-torch-compile (bucket 1), alone
     and with --quantization int8 (floor: of the unquantized weights)
                                         -> b1_compiled_ratio_vs_hf, b1_compiled_vs_bandwidth_floor,
                                            b1_int8_compiled_ratio_vs_hf, ..._vs_bandwidth_floor
  3. steady decode, 32 requests: the engine loop vs a raw ModelRunner.forward + Sampler loop
                                                              -> engine_vs_raw_forward
     the overlap loop vs the normal loop, each engine in a process of its own
     (bench/engine_loops.py)                                  -> overlap_vs_normal
  4. levers: decode forward with vs without oneDNN weight prepacking, batch 1 and 32
                                                              -> prepack_speedup_b1/_bs32
     --quantization int8 (weight-only) vs the eager (prepacked) step
                                                              -> int8_speedup_b1/_bs32
     with --torch-compile: the inductor-compiled decode step vs the eager (prepacked) one
                                                              -> compile_speedup_b1/_bs32
  --cpu-kernels-ab (alone, ~2-4 min): offline throughput with pdserve's fused C kernels
     (common/model/cpu_kernels; bf16 on CPU: fused ops, decode attention, batch-1 linears) vs
     torch's ops and oneDNN alone, swapped in one engine between rounds, rounds alternating: c16-like (16 x 256-token prompts x 64
     new tokens, chunked prefill + decode) and batch 1 (64-token prompt x 64 new)
                                          -> cpu_kernels_speedup_c16, cpu_kernels_speedup_b1
Last line: RESULT {json} with those keys, the tok/s behind them, the CPU (model, flags), the
dtype and the load average at the start and the end (a shared box moves every figure).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from typing import Any

import transformers
from engine_loops import LOOPS, LoopChild, steady_work
from engine_parts import (
    best_of,
    cpu_description,
    decode_step_seconds,
    read_bandwidth_gbs,
    run_engine,
    run_hf_static,
    run_raw_decode,
    uniform_work,
    weight_bytes_per_token,
)

from common.engine import Engine
from common.model.compiled_decode import CompileCapture
from common.model.config import resolve_dtype
from common.model.cpu_fused_ops import CpuFusedOps
from common.model.decode_graphs import SomeBuckets
from common.model.default_model import resolve_model_path
from common.model.fused_ops import TorchOps
from common.model.model_runner import ModelRunner
from common.model.packed_linear import PackedLinear

SIZES = {  # quick, full
    "uniform_prompts": (8, 32),
    "uniform_new": (32, 64),
    "b1_new": (32, 128),
    "steady_steps": (32, 96),
    "reps": (1, 2),
    "loop_rounds": (4, 6),  # overlap vs normal differ by a few percent: alternate, keep each one's best
}


def engine_args(batch: int, **extra: Any) -> dict[str, Any]:
    return dict(page_size=16, chunked_prefill_size=512, max_prefill_tokens=4096, max_running_requests=batch,
                max_total_tokens=65536, **extra)


def part_vs_hf(engine: Engine, hf: transformers.PreTrainedModel, work: list[tuple[list[int], int]],
               reps: int, label: str, out: dict[str, Any]) -> tuple[float, float]:
    toks = sum(n for _, n in work)
    t_engine, t_hf = best_of(reps, lambda: run_engine(engine, work), lambda: run_hf_static(hf, work, len(work)))
    e_tps, h_tps = toks / t_engine, toks / t_hf
    print(f"[{label}] {len(work)} x {work[0][1]} new tokens: engine {e_tps:.1f} tok/s, transformers "
          f"{h_tps:.1f} tok/s, ratio {e_tps / h_tps:.2f}x", flush=True)
    out[f"{label}_engine_tok_s"], out[f"{label}_hf_tok_s"] = round(e_tps, 1), round(h_tps, 1)
    return t_engine, t_hf


RESULT_KEYS = (  # always in the RESULT line (issue 16's figures), beside the tok/s behind them
    "uniform_ratio_vs_hf", "b1_ratio_vs_hf", "b1_vs_bandwidth_floor", "overlap_vs_normal", "engine_vs_raw_forward",
    "cpu", "dtype", "load_avg",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--dtype", default="auto", help="auto (bfloat16 only with avx512_bf16/amx_bf16), float32 or bfloat16")
    ap.add_argument("--quick", action="store_true", help="small sizes, one round per side")
    ap.add_argument("--decode-batch", type=int, default=32)
    ap.add_argument("--torch-compile", action="store_true",
                    help="also measure the --enable-torch-compile decode step (compiles buckets 1 and the decode batch)")
    ap.add_argument("--cpu-kernels-ab", action="store_true",
                    help="only the fused-C-kernels A/B (offline c16-like and batch 1), then RESULT")
    return ap.parse_args(argv)


def cpu_kernels_ab(path: str, dtype_name: str, rounds: int) -> dict[str, Any]:
    """Offline throughput, fused C kernels on vs off, in ONE engine: between rounds the runner's
    ops (CpuFusedOps / TorchOps) and its attention backend's decode kernel are swapped, so both
    sides share the weights, the pool, the threads and whatever load the box has."""
    engine = Engine(path, dtype=dtype_name, **engine_args(16, disable_overlap_schedule=True) | {
        "max_total_tokens": 16384, "chunked_prefill_size": 256})
    runner = engine.core.runner
    backend = runner.attn_backend
    fused_ops, kernels = runner.model.ops, getattr(backend, "_kernels", None)
    if not isinstance(fused_ops, CpuFusedOps) or kernels is None:
        raise SystemExit(f"the fused CPU kernels are not active here (ops {type(fused_ops).__name__}); "
                         "they need a CPU, bf16 and a C compiler")

    packed = [m for m in runner.model.modules() if isinstance(m, PackedLinear) and m._gemv is not None]

    def switch(on: bool) -> None:
        runner.model.ops, backend._kernels = (fused_ops, kernels) if on else (TorchOps(), None)  # type: ignore[attr-defined]
        for m in packed:
            m._gemv = kernels if on else None

    def run(on: bool, w: list[tuple[list[int], int]]) -> float:
        switch(on)
        return run_engine(engine, w)

    vocab = engine.vocab_size
    work = {"c16": uniform_work(16, vocab, (256, 256), 64, seed=3), "b1": uniform_work(1, vocab, (64, 64), 64, seed=4)}
    for on in (True, False):
        run(on, uniform_work(2, vocab, (32, 96), 4, seed=9))  # warm up
    result: dict[str, Any] = {}
    for name, w in work.items():
        toks = sum(n for _, n in w)
        t_on, t_off = best_of(rounds, lambda w=w: run(True, w), lambda w=w: run(False, w))  # type: ignore[misc]
        result[f"cpu_kernels_speedup_{name}"] = round(t_off / t_on, 3)
        result[f"{name}_tok_s_kernels_on"], result[f"{name}_tok_s_kernels_off"] = round(toks / t_on, 1), round(toks / t_off, 1)
        print(f"[cpu kernels {name}] {len(w)} x {len(w[0][0])} in / {w[0][1]} out: on {toks / t_on:.1f} tok/s, "
              f"off {toks / t_off:.1f} tok/s ({t_off / t_on:.2f}x)", flush=True)
    switch(True)
    engine.shutdown()
    return result


def result_line(result: dict[str, Any]) -> str:
    """The last line of the bench: RESULT {json}; every RESULT_KEYS key must be there."""
    missing = [k for k in RESULT_KEYS if k not in result]
    if missing:
        raise ValueError(f"RESULT lacks {missing}")
    return "RESULT " + json.dumps(result)


def load_avg() -> float:
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else -1.0


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    q = 0 if args.quick else 1
    size = {k: v[q] for k, v in SIZES.items()}
    reps = size["reps"]
    path = resolve_model_path(args.model_path)
    dtype = resolve_dtype(args.dtype, "cpu")
    dtype_name = str(dtype).removeprefix("torch.")
    cpu = cpu_description()
    load_start = load_avg()
    print(f"CPU: {cpu['model']} flags {cpu['flags']} threads {cpu['threads']}; dtype {dtype_name}; "
          f"load average {load_start}", flush=True)
    result: dict[str, Any] = {"cpu": cpu, "dtype": dtype_name, "quick": args.quick}
    if args.cpu_kernels_ab:
        result.update(cpu_kernels_ab(path, dtype_name, 2 if args.quick else 3), load_avg=[load_start, load_avg()])
        print("RESULT " + json.dumps(result))
        return
    bs = max(size["uniform_prompts"], args.decode_batch)
    normal = Engine(path, dtype=dtype_name, **engine_args(bs, disable_overlap_schedule=True))
    vocab = normal.vocab_size
    run_engine(normal, uniform_work(2, vocab, (32, 96), 4, seed=9))  # warm up
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()

    # 1. uniform batch, 2. batch 1
    uniform = uniform_work(size["uniform_prompts"], vocab, (32, 96), size["uniform_new"])
    t_e, t_h = part_vs_hf(normal, hf, uniform, reps, "uniform", result)
    result["uniform_ratio_vs_hf"] = round(t_h / t_e, 3)
    single = uniform_work(1, vocab, (64, 64), size["b1_new"], seed=1)
    t_e, t_h = part_vs_hf(normal, hf, single, reps, "b1", result)
    result["b1_ratio_vs_hf"] = round(t_h / t_e, 3)
    del hf
    bandwidth = read_bandwidth_gbs()
    weight_bytes = weight_bytes_per_token(normal.core.runner)
    floor_s = weight_bytes / (bandwidth * 1e9)
    b1_step = decode_step_seconds(normal.core.runner, 1, 64, size["b1_new"])
    result["b1_vs_bandwidth_floor"] = round((t_e / size["b1_new"]) / floor_s, 3)
    print(f"[b1] read bandwidth {bandwidth:.1f} GB/s, {weight_bytes / 1e6:.0f} MB of weights per token: floor "
          f"{1000 * floor_s:.1f} ms/token; engine {1000 * t_e / size['b1_new']:.1f} ms/token end to end, "
          f"raw decode forward {1000 * b1_step:.1f} ms", flush=True)
    result.update(read_bandwidth_gbs=round(bandwidth, 1), b1_forward_ms=round(1000 * b1_step, 2))
    if args.torch_compile:  # batch 1 again through engines compiled for bucket 1 (~1 min of autotuning each)
        variants: list[tuple[str, dict[str, Any]]] = [("compiled", {})]
        variants.append(("int8_compiled", {"quantization": "int8"}))
        for label, extra in variants:
            compiled_engine = Engine(path, dtype=dtype_name, **engine_args(  # on this thread's OpenMP pool, as `normal`
                1, enable_torch_compile=True, torch_compile_max_bs=1, disable_overlap_schedule=True, **extra))
            run_engine(compiled_engine, single)  # warm up
            t_c = best_of(reps, lambda e=compiled_engine: run_engine(e, single))[0]  # type: ignore[misc]
            compiled_engine.shutdown()
            result[f"b1_{label}_ratio_vs_hf"] = round(t_h / t_c, 3)
            result[f"b1_{label}_vs_bandwidth_floor"] = round((t_c / size["b1_new"]) / floor_s, 3)
            print(f"[b1 {label}] engine {size['b1_new'] / t_c:.1f} tok/s ({1000 * t_c / size['b1_new']:.1f} ms/token): "
                  f"{t_h / t_c:.2f}x transformers, {(t_c / size['b1_new']) / floor_s:.2f}x the floor", flush=True)

    # 3. steady decode: engine loop vs raw loop (this process); overlap vs normal (a process each)
    rng = random.Random(1)
    steps, batch = size["steady_steps"], args.decode_batch
    prompts = [[rng.randrange(100, vocab) for _ in range(64)] for _ in range(batch)]
    steady = steady_work(batch, steps, vocab)
    t_raw, t_normal = best_of(
        reps, lambda: run_raw_decode(normal, prompts, steps), lambda: run_engine(normal, steady),
    )
    loops = [LoopChild(loop, model_path=args.model_path, dtype=dtype_name, batch=batch) for loop in LOOPS]
    try:
        t_child_normal, t_child_overlap = best_of(size["loop_rounds"], *(lambda c=c: c.run(batch, steps) for c in loops))  # type: ignore[misc]
    finally:
        for child in loops:
            child.close()
    toks = batch * steps
    print(f"[steady] {batch} x {steps}: raw forward+sample {toks / t_raw:.1f} tok/s, engine normal "
          f"{toks / t_normal:.1f}; a process per loop: normal {toks / t_child_normal:.1f}, overlap "
          f"{toks / t_child_overlap:.1f} tok/s", flush=True)
    result.update(
        engine_vs_raw_forward=round(t_raw / t_normal, 3), overlap_vs_normal=round(t_child_normal / t_child_overlap, 3),
        steady_normal_tok_s=round(toks / t_child_normal, 1), steady_overlap_tok_s=round(toks / t_child_overlap, 1),
    )

    # 4. levers: oneDNN weight prepacking, weight-only int8, and (--torch-compile) the
    # inductor-compiled decode step
    runner = normal.core.runner
    levers: list[tuple[str, ModelRunner]] = []
    if runner.weights_prepacked:
        levers.append(("prepack", ModelRunner(path, dtype=dtype, kv_pool=runner.kv_pool,
                                              req_to_token=runner.req_to_token, cpu_weight_prepack=False)))
    if args.torch_compile:
        compiled = ModelRunner(path, dtype=dtype, kv_pool=runner.kv_pool, req_to_token=runner.req_to_token,
                               keep_plain_weights=True)
        capture = CompileCapture(compiled.kv_pool, compiled.attn_backend)
        wanted = {1, batch}
        compiled.enable_decode_graphs(batch, SomeBuckets(capture, wanted))
        levers.append(("compile", compiled))
    levers.append(("int8", ModelRunner(path, dtype=dtype, kv_pool=runner.kv_pool,  # its kernel: bf16 activations
                                       req_to_token=runner.req_to_token, quantization="int8")))
    for name, other in levers:
        for b, key in ((1, f"{name}_speedup_b1"), (batch, f"{name}_speedup_bs{batch}")):
            base, lever = (other, runner) if name == "prepack" else (runner, other)
            t_base, t_lever = best_of(reps + 1, lambda b=b, r=base: decode_step_seconds(r, b, 64, 4),  # type: ignore[misc]
                                      lambda b=b, r=lever: decode_step_seconds(r, b, 64, 4))  # type: ignore[misc]
            result[key] = round(t_base / t_lever, 3)
            print(f"[{name}] batch {b} decode forward: without {1000 * t_base:.1f} ms, with "
                  f"{1000 * t_lever:.1f} ms ({t_base / t_lever:.2f}x)", flush=True)
    normal.shutdown()
    result["load_avg"] = [load_start, load_avg()]
    print(result_line(result))


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"(bench took {time.perf_counter() - start:.0f} s)")
