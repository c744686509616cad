"""GPU checks that launch/gpu_check.sh runs (each prints one `RESULT {json}` line).

    python bench/gpu_checks.py syncs MODEL              host syncs inside ModelRunner.forward over
                                                        100 decode steps (flashinfer, batch 32)
    python bench/gpu_checks.py overlap MODEL            the engine's overlap loop (one thread: launch
                                                        N+1, then collect N; worker stream, CUDA
                                                        graphs), 32 requests decoding: host syncs,
                                                        kernels and kernel launches per decode step,
                                                        and the GPU's idle fraction
    python bench/gpu_checks.py reference MODEL OUT      greedy ids of PROMPTS from the offline engine
                                                        (CUDA, flashinfer), one request at a time
    python bench/gpu_checks.py parity URL REF           the same prompts through a router: equal ids?
    python bench/gpu_checks.py record URL MODEL OUT     greedy ids of PROMPTS from a server (e.g. a
                                                        colocated instance: PD == colocated by parity)
    (reference and record take --num-prompts N, default 12, at most 16)

Syncs are counted with torch.cuda.set_sync_debug_mode("warn"): in `syncs` around the forward
only (the batch is built outside the window); in `overlap` around whole engine steps (budget:
1 per step, the wait on the previous step's tokens). Kernels and idle time come from
torch.profiler over a window of decode-only steps: idle = 1 - (union of kernel intervals) /
(the window's span).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
import warnings

import torch

from common.model.config import ModelConfig
from common.model.forward_batch import ForwardBatch, ForwardMode
from common.model.model_runner import ModelRunner

PAGE = 16
NUM_PROMPTS = 12
MAX_NEW_TOKENS = 32
# `reference` runs this backend (torch: a GPU run without flashinfer's JIT build)
REFERENCE_BACKEND = os.environ.get("PDSERVE_ATTENTION_BACKEND", "flashinfer")


def prompts(vocab: int, num: int = NUM_PROMPTS) -> list[list[int]]:
    """Lengths across page boundaries and chunked prefill (512): 1 .. 1000 tokens."""
    rng = random.Random(0)
    lengths = [1, 15, 16, 17, 64, 200, 511, 513, 700, 33, 128, 300, 1000, 2, 257, 90][:num]
    return [[rng.randrange(100, min(vocab, 30000)) for _ in range(n)] for n in lengths]


def count_syncs(model_path: str, rows: int = 32, prompt_len: int = 64, steps: int = 100) -> dict[str, float]:
    device = torch.device("cuda", torch.cuda.current_device())
    ctx = (prompt_len + steps + PAGE) // PAGE * PAGE
    config = ModelConfig.from_pretrained(model_path)
    pool = ModelRunner.create_kv_pool(config, max_total_tokens=rows * ctx, page_size=PAGE, dtype="bfloat16", device=device)
    table = torch.arange(rows * ctx, dtype=torch.int32).view(rows, ctx) + PAGE  # page 0 stays reserved
    r2t = table.to(device)
    runner = ModelRunner(model_path, dtype="bfloat16", device=device, kv_pool=pool, req_to_token=r2t,
                         attention_backend="flashinfer")
    row_ids = list(range(rows))
    ids = [7] * (rows * prompt_len)
    positions = [p for _ in row_ids for p in range(prompt_len)]
    slots = [int(table[r, p]) for r in row_ids for p in range(prompt_len)]
    runner.forward(ForwardBatch.build(ForwardMode.EXTEND, ids, positions, slots, row_ids, [prompt_len] * rows,
                                      [0] * rows, device=device))
    torch.cuda.synchronize()
    syncs, elapsed = 0, 0.0
    for step in range(steps):
        pos = prompt_len + step
        batch = ForwardBatch.build(ForwardMode.DECODE, [7] * rows, [pos] * rows, [int(table[r, pos]) for r in row_ids],
                                   row_ids, [pos + 1] * rows, [pos] * rows, device=device)
        torch.cuda.synchronize()
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                runner.forward(batch)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        elapsed += time.perf_counter() - start
        syncs += sum("synchroniz" in str(w.message) for w in caught)
    return {"decode_steps": steps, "rows": rows, "syncs_per_step": syncs / steps, "ms_per_step": 1e3 * elapsed / steps}


def overlap_profile(model_path: str, rows: int = 32, prompt_len: int = 64, window: int = 40) -> dict[str, float]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from common.engine import Engine
    from common.sampling_params import SamplingParams
    from common.scheduler.req import Req

    engine = Engine(model_path, device="cuda", attention_backend="flashinfer", dtype="bfloat16",
                    max_total_tokens=65536, max_running_requests=rows)
    sched = engine.scheduler
    rng = random.Random(0)
    params = SamplingParams(max_new_tokens=3 * window + 32, temperature=0.0, ignore_eos=True)
    for i in range(rows):
        ids = [rng.randrange(100, min(engine.vocab_size, 30000)) for _ in range(prompt_len)]
        sched.add_request(Req(rid=f"r{i}", origin_input_ids=ids, sampling_params=params))
    for _ in range(10_000):  # until every request decodes (bounded)
        if not (sched.waiting or sched.chunked) and sched.num_decode_steps >= 4:
            break
        sched.step()
    torch.cuda.synchronize()
    first = sched.num_decode_steps
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(window):
                sched.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    steps = sched.num_decode_steps - first
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(window):
            sched.step()
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    events = list(prof.events())
    kernels = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA)
    launches = sum(e.name in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cudaGraphLaunch")
                   for e in events)
    busy, end = 0.0, float("-inf")
    for a, b in kernels:  # union of the kernel intervals
        if b > end:
            busy += b - max(a, end)
            end = b
    span = max(e.time_range.end for e in events) - min(e.time_range.start for e in events)
    engine.shutdown()
    return {
        "rows": rows, "decode_steps": steps, "syncs_per_step": syncs / max(steps, 1),
        "kernels_per_step": len(kernels) / window, "launches_per_step": launches / window,
        "gpu_idle_fraction": round(1 - busy / max(span, 1e-9), 3), "ms_per_step": 1e3 * elapsed / window,
        "cuda_graphs": float(engine.core.runner.decode_graphs is not None),
    }


def reference(model_path: str, out: str, num: int = NUM_PROMPTS) -> dict[str, float]:
    from common.engine import Engine

    engine = Engine(model_path, device="cuda", attention_backend=REFERENCE_BACKEND, dtype="bfloat16",
                    max_total_tokens=65536)
    try:
        greedy = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        ps = prompts(engine.vocab_size, num)
        outs = [engine.generate(input_ids=p, sampling_params=greedy)["output_ids"] for p in ps]
    finally:
        engine.shutdown()
    with open(out, "w") as f:
        json.dump({"prompts": ps, "outputs": outs}, f)
    return {"prompts": len(ps)}


def parity(url: str, ref_path: str) -> dict[str, float]:
    import httpx

    with open(ref_path) as f:
        ref = json.load(f)
    same, prefix = 0, []
    greedy = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    with httpx.Client(timeout=300, trust_env=False) as client:
        for ids, want in zip(ref["prompts"], ref["outputs"], strict=True):
            got = client.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": greedy}).json()["output_ids"]
            same += got == want
            prefix.append(next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), len(want)))
    return {"prompts": len(ref["prompts"]), "identical": same, "min_common_prefix": min(prefix)}


def record(url: str, model_path: str, out: str, num: int = NUM_PROMPTS) -> dict[str, float]:
    import httpx

    vocab = json.load(open(os.path.join(model_path, "config.json")))["vocab_size"]
    ps = prompts(vocab, num)
    greedy = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    with httpx.Client(timeout=300, trust_env=False) as client:
        outs = [client.post(f"{url}/generate", json={"input_ids": p, "sampling_params": greedy}).json()["output_ids"]
                for p in ps]
    with open(out, "w") as f:
        json.dump({"prompts": ps, "outputs": outs}, f)
    return {"prompts": len(ps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="check", required=True)
    sub.add_parser("syncs").add_argument("model")
    sub.add_parser("overlap").add_argument("model")
    ref = sub.add_parser("reference")
    ref.add_argument("model")
    ref.add_argument("out")
    ref.add_argument("--num-prompts", type=int, default=NUM_PROMPTS)
    rec = sub.add_parser("record")
    rec.add_argument("url")
    rec.add_argument("model")
    rec.add_argument("out")
    rec.add_argument("--num-prompts", type=int, default=NUM_PROMPTS)
    par = sub.add_parser("parity")
    par.add_argument("url")
    par.add_argument("ref")
    a = parser.parse_args()
    if a.check == "syncs":
        result = count_syncs(a.model)
    elif a.check == "overlap":
        result = overlap_profile(a.model)
    elif a.check == "reference":
        result = reference(a.model, a.out, a.num_prompts)
    elif a.check == "record":
        result = record(a.url, a.model, a.out, a.num_prompts)
    else:
        result = parity(a.url, a.ref)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
