"""Offline engine throughput: our Engine vs transformers, engine loop vs raw forward, overlap vs normal.

    python bench/engine.py                       # default model (SmolLM2-135M), bf16 + fp32
    python bench/engine.py --num-prompts 16 --quick

Parts (all in one process, same checkpoint, same dtype):
  1. mixed workload (prompts 16-512 tokens, outputs 16-256 tokens, greedy, ignore_eos):
     Engine vs transformers `generate` on static padded batches of --hf-batch-size
     (only the requested tokens count as useful output).
  2. steady decode: --decode-batch requests x 64-token prompts, --decode-steps steps:
     the engine loop vs a raw loop calling ModelRunner.forward + Sampler on the same shapes.
  3. overlap vs normal loop on the workload of part 2; scheduler CPU ms per step.
Last line: RESULT {json} with engine_tok_s, hf_static_tok_s, ratio_vs_hf_static (bf16),
engine_vs_raw_forward, overlap_vs_normal, sched_ms_per_step.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
import transformers

from common.engine import Engine
from common.model.default_model import resolve_model_path
from common.model.forward_batch import ForwardBatch, ForwardMode
from common.model.sampling_info import SamplingBatchInfo
from common.sampling_params import SamplingParams


def mixed_workload(n: int, vocab: int, seed: int, max_prompt: int, max_out: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(100, vocab) for _ in range(rng.randint(16, max_prompt))], rng.randint(16, max_out))
        for _ in range(n)
    ]


def run_engine(engine: Engine, work: list[tuple[list[int], int]]) -> float:
    params = [{"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True} for _, n in work]
    start = time.perf_counter()
    outs = engine.generate(input_ids=[p for p, _ in work], sampling_params=params)
    elapsed = time.perf_counter() - start
    assert sum(o["meta_info"]["completion_tokens"] for o in outs) == sum(n for _, n in work)  # type: ignore[index]
    return elapsed


@torch.inference_mode()
def run_hf_static(model: transformers.PreTrainedModel, work: list[tuple[list[int], int]], batch: int) -> float:
    start = time.perf_counter()
    for i in range(0, len(work), batch):
        group = work[i : i + batch]
        width = max(len(p) for p, _ in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for j, (p, _) in enumerate(group):
            ids[j, width - len(p) :] = torch.tensor(p)
            mask[j, width - len(p) :] = 1
        model.generate(
            ids, attention_mask=mask, max_new_tokens=max(n for _, n in group), do_sample=False,
            eos_token_id=[], pad_token_id=0,
        )
    return time.perf_counter() - start


@torch.inference_mode()
def run_raw_decode(engine: Engine, prompts: list[list[int]], steps: int) -> float:
    """Prefill + `steps` decode steps straight through ModelRunner + Sampler (no scheduler)."""
    core = engine.core
    runner, sampler = core.runner, core.scheduler.executor.worker.sampler
    ps = core.kv_pool.page_size
    table = runner.req_to_token
    bs = len(prompts)
    span = (max(len(p) for p in prompts) + steps + ps) // ps * ps
    for r in range(bs):  # each request gets a contiguous run of slots after the reserved page
        table[r, :span] = torch.arange(ps + r * span, ps + (r + 1) * span)
    params = [SamplingParams(max_new_tokens=steps, temperature=0.0)] * bs
    info = SamplingBatchInfo.from_params(params, list(range(bs)), vocab_size=runner.vocab_size)
    start = time.perf_counter()
    fb = ForwardBatch.build(
        ForwardMode.EXTEND,
        [t for p in prompts for t in p],
        [i for p in prompts for i in range(len(p))],
        [int(table[r, i]) for r, p in enumerate(prompts) for i in range(len(p))],
        list(range(bs)), [len(p) for p in prompts], [0] * bs,
    )
    tokens = sampler.sample(runner.forward(fb), info).next_token_ids
    lens = [len(p) for p in prompts]
    for _ in range(steps - 1):
        fb = ForwardBatch.build(
            ForwardMode.DECODE, tokens.tolist(), lens, [int(table[r, lens[r]]) for r in range(bs)],
            list(range(bs)), [n + 1 for n in lens], lens,
        )
        tokens = sampler.sample(runner.forward(fb), info).next_token_ids
        lens = [n + 1 for n in lens]
    elapsed = time.perf_counter() - start
    table[:bs].zero_()
    return elapsed


def run_steady(engine: Engine, work: list[tuple[list[int], int]], sched_ms: list[float]) -> float:
    """run_engine; on the overlap loop (the forward runs in the other thread) also appends the
    scheduler's CPU ms per step to `sched_ms`."""
    busy0, steps0 = engine.scheduler.busy_seconds, engine.scheduler.num_steps
    t = run_engine(engine, work)
    if engine.args.overlap_schedule:
        steps = max(1, engine.scheduler.num_steps - steps0)
        sched_ms.append(1000 * (engine.scheduler.busy_seconds - busy0) / steps)
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-prompt-len", type=int, default=512)
    ap.add_argument("--max-output-len", type=int, default=256)
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--decode-batch", type=int, default=32)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    args = ap.parse_args()
    if args.quick:
        args.num_prompts, args.max_prompt_len, args.max_output_len = 8, 64, 32
        args.hf_batch_size, args.decode_batch, args.decode_steps = 8, 8, 16
    path = resolve_model_path(args.model_path)
    result: dict[str, float] = {}
    for dtype in args.dtypes.split(","):
        engine = Engine(path, dtype=dtype, page_size=16, chunked_prefill_size=512, max_prefill_tokens=4096,
                        max_running_requests=max(args.num_prompts, args.decode_batch), max_total_tokens=131072)
        work = mixed_workload(args.num_prompts, engine.vocab_size, 0, args.max_prompt_len, args.max_output_len)
        useful = sum(n for _, n in work)
        run_engine(engine, work[:2])  # warm up
        t_engine = run_engine(engine, work)
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
        t_hf = run_hf_static(hf, work, args.hf_batch_size)
        del hf
        e_tps, h_tps = useful / t_engine, useful / t_hf
        print(f"[{dtype}] mixed workload {len(work)} prompts, {useful} output tokens: "
              f"engine {e_tps:.1f} tok/s ({t_engine:.1f} s), transformers static {h_tps:.1f} tok/s "
              f"({t_hf:.1f} s), ratio {e_tps / h_tps:.2f}x")
        tag = "" if dtype == "bfloat16" else "_fp32"
        result[f"engine_tok_s{tag}"] = round(e_tps, 1)
        result[f"hf_static_tok_s{tag}"] = round(h_tps, 1)
        result[f"ratio_vs_hf_static{tag}"] = round(e_tps / h_tps, 3)

        if dtype == "bfloat16":
            rng = random.Random(1)
            prompts = [[rng.randrange(100, engine.vocab_size) for _ in range(64)] for _ in range(args.decode_batch)]
            steady = [(p, args.decode_steps) for p in prompts]
            t_raw = run_raw_decode(engine, prompts, args.decode_steps)
            sched_ms: list[float] = []
            t_default = run_steady(engine, steady, sched_ms)  # the default loop: overlap on CUDA, normal on CPU
            default_overlap = engine.args.overlap_schedule
            engine.shutdown()
            other = Engine(path, dtype=dtype, page_size=16, max_running_requests=args.decode_batch,
                           max_total_tokens=131072, disable_overlap_schedule=default_overlap,
                           enable_cpu_overlap_schedule=not default_overlap)
            run_engine(other, steady[:2])
            t_other = run_steady(other, steady, sched_ms)
            other.shutdown()
            t_overlap, t_normal = (t_default, t_other) if default_overlap else (t_other, t_default)
            toks = args.decode_batch * args.decode_steps
            print(f"[{dtype}] steady decode {args.decode_batch} x {args.decode_steps}: raw forward "
                  f"{toks / t_raw:.1f} tok/s, engine overlap {toks / t_overlap:.1f} tok/s, engine normal "
                  f"{toks / t_normal:.1f} tok/s (default here: {'overlap' if default_overlap else 'normal'}); "
                  f"scheduler CPU {sched_ms[0]:.2f} ms/step")
            result["engine_vs_raw_forward"] = round(t_raw / t_default, 3)
            result["overlap_vs_normal"] = round(t_normal / t_overlap, 3)
            result["sched_ms_per_step"] = round(sched_ms[0], 3)
        else:
            engine.shutdown()
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
