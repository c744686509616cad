"""Operators per decode step at batch 1 on CPU, counted with torch.profiler.

    python bench/step_ops.py [--model-path default] [--steps 20] [--dtype float32] [--top 15]

On a GPU each operator outside a CUDA graph is at least one kernel launch (~3-5 us of host
time), so at batch 1, where the weights stream in well under a millisecond, their count decides
how close a step gets to the weight-streaming floor. Counted over whole scheduler steps
(normal loop: scheduling, staging, forward, sampling, the token read-back):
`ops_per_step` are the operators the Python code calls (top-level profiler events), `all_ops`
includes the ones they call inside, `kernel_calls_per_step` the calls into pdserve's fused C
kernels (common/model/cpu_kernels: CPU, bf16), which the profiler does not see, each doing the
work of several operators. `ms_per_step` is timed without the profiler, `ms_per_step_profiled`
with it. Ends with RESULT {"ops_per_step", "all_ops_per_step", "kernel_calls_per_step", "layers",
"ms_per_step", "ms_per_step_profiled", "top"}.
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from common.engine import Engine
from common.model.cpu_kernels import cpu_kernels
from common.model.default_model import resolve_model_path
from common.sampling_params import SamplingParams
from common.scheduler.req import Req


def count_ops(model_path: str, steps: int, dtype: str, top: int) -> dict[str, object]:
    engine = Engine(model_path, dtype=dtype, page_size=16, max_total_tokens=4096, max_running_requests=1,
                    disable_overlap_schedule=True)
    sched = engine.scheduler
    params = SamplingParams(max_new_tokens=2 * steps + 40, temperature=0.0, ignore_eos=True)
    sched.add_request(Req(rid="r", origin_input_ids=list(range(100, 164)), sampling_params=params))
    while sched.num_decode_steps < 10:  # past the prefill and the first decode steps
        sched.step()
    kernels = cpu_kernels()
    calls = kernels.calls if kernels is not None else 0
    start = time.perf_counter()
    for _ in range(steps):
        sched.step()
    plain = time.perf_counter() - start
    calls = (kernels.calls - calls) if kernels is not None else 0
    first = sched.num_decode_steps
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            sched.step()
    elapsed = time.perf_counter() - start
    assert sched.num_decode_steps - first == steps
    events = [e for e in prof.events() if not e.name.startswith(("ProfilerStep", "[memory]"))]
    top_level = [e for e in events if e.cpu_parent is None]
    names = collections.Counter(e.name for e in top_level)
    layers = engine.core.model_config.num_layers
    engine.shutdown()
    return {
        "ops_per_step": round(len(top_level) / steps, 1), "all_ops_per_step": round(len(events) / steps, 1),
        "kernel_calls_per_step": round(calls / steps, 1), "layers": layers,
        "ms_per_step": round(1e3 * plain / steps, 2), "ms_per_step_profiled": round(1e3 * elapsed / steps, 2),
        "top": {name: round(n / steps, 2) for name, n in names.most_common(top)},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default="default")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--top", type=int, default=15)
    a = p.parse_args()
    torch.set_num_threads(1)
    result = count_ops(resolve_model_path(a.model_path), a.steps, a.dtype, a.top)
    for name, n in result["top"].items():  # type: ignore[attr-defined]
        print(f"{n:8.2f}  {name}")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
