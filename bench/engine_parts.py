"""Pieces of bench/engine.py: workloads, the transformers baselines, raw loops, the box itself."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from common.engine import Engine
from common.model.forward_batch import ForwardBatch, ForwardMode
from common.model.model_runner import ModelRunner
from common.model.sampling_info import SamplingBatchInfo
from common.sampling_params import SamplingParams

Work = list[tuple[list[int], int]]  # (prompt ids, new tokens) per request
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_description() -> dict[str, object]:
    """The CPU model, the flags that decide fp32/bf16 speed, and the intra-op threads."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    flags_line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    have = set(flags_line.split(":", 1)[-1].split())
    return {"model": model, "flags": [f for f in CPU_FLAGS if f in have], "threads": torch.get_num_threads()}


def read_bandwidth_gbs(mib: int = 512) -> float:
    """Best of 5 full reads (sum) of a `mib` MiB float32 tensor, GB/s, all intra-op threads."""
    x = torch.ones(mib * 2**20 // 4)
    x.sum()
    best = min(_timed(x.sum) for _ in range(5))
    return x.numel() * 4 / best / 1e9


def weight_bytes_per_token(runner: ModelRunner) -> int:
    """Bytes one decode token streams: every weight but the embedding table (a lookup reads one
    row), plus the logits projection (its packed copy, its own weight, or the tied embedding)."""
    model = runner.model
    embed = model.model.embed_tokens.weight
    embed_bytes = embed.numel() * embed.element_size()
    total = sum(p.numel() * p.element_size() for p in model.parameters()) - embed_bytes
    head_reads_embedding = model.head_linear is None and model.lm_head is None
    return total + (embed_bytes if head_reads_embedding else 0)


def uniform_work(n: int, vocab: int, prompt_range: tuple[int, int], new_tokens: int, seed: int = 0) -> Work:
    rng = random.Random(seed)
    return [([rng.randrange(100, vocab) for _ in range(rng.randint(*prompt_range))], new_tokens) for _ in range(n)]


def run_engine(engine: Engine, work: Work) -> float:
    params = [{"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True} for _, n in work]
    start = time.perf_counter()
    outs = engine.generate(input_ids=[p for p, _ in work], sampling_params=params)
    elapsed = time.perf_counter() - start
    assert sum(o["meta_info"]["completion_tokens"] for o in outs) == sum(n for _, n in work)  # type: ignore[index]
    return elapsed


@torch.inference_mode()
def run_hf_static(model: transformers.PreTrainedModel, work: Work, batch: int) -> float:
    """transformers `generate`, greedy, in static left-padded batches of `batch` prompts."""
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
    runner, sampler = core.runner, core.scheduler.executor.worker.sampler  # type: ignore[attr-defined]
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


@torch.inference_mode()
def decode_step_seconds(runner: ModelRunner, batch: int, context: int, steps: int) -> float:
    """Mean seconds of one decode forward of `batch` requests at `context` tokens (KV content is
    whatever the pool holds: the cost does not depend on it)."""
    ps = runner.kv_pool.page_size
    span = (context + steps + ps) // ps * ps
    table = runner.req_to_token
    for r in range(batch):
        table[r, :span] = torch.arange(ps + r * span, ps + (r + 1) * span)

    def step(n: int) -> None:
        fb = ForwardBatch.build(
            ForwardMode.DECODE, [7] * batch, [n] * batch, [int(table[r, n]) for r in range(batch)],
            list(range(batch)), [n + 1] * batch, [n] * batch,
        )
        runner.forward(fb)

    step(context)
    start = time.perf_counter()
    for i in range(steps):
        step(context + i)
    elapsed = (time.perf_counter() - start) / steps
    table[:batch].zero_()
    return elapsed


def best_of(reps: int, *fns: Callable[[], float]) -> list[float]:
    """Each fn's best time over `reps` rounds, rounds interleaved (A B A B) so that load from
    elsewhere on a shared box hits every side alike."""
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            best[i] = min(best[i], fn())
    return best


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
