"""Peer bench: the same SGLang bench_serving workloads against several OpenAI servers, one after the other.

    python bench/peer.py --system colocated=launch:colocated --system pd=launch:pd \
        --system vllm=cmd:"/work/vllm-venv/bin/python -m vllm.entrypoints.openai.api_server \
            --model {model} --dtype bfloat16 --host 127.0.0.1 --port {port}"

Each system is started in turn (bench/peer_systems.py: launch/pd.sh topologies, any command
line, or an already running url), waited for (bounded), measured, and stopped fully before
the next one starts, so that the systems never share the box. The client is SGLang's own
bench_serving (bench/peer_client.py), with the same prompts for every system:

    b1   batch 1: --b1-prompts requests, one at a time (TPOT and TTFT of a lone request)
    c16  --c16-prompts requests, at most --c16-concurrency in flight (throughput under load)

both random-ids prompts of exactly --input-len tokens asking for exactly --output-len tokens
(ignore_eos), temperature 0, after warmup requests at the workload's concurrency. The model
is --model-path (default: the project's default model) in --dtype (default bfloat16); a cmd
system gets it as `{model}`. Prints a table, then as last line `RESULT {json}`
(bench/peer_report.py: per-system figures, the ratios colocated_vs_vllm_c16_tput,
pd_vs_colocated_c16_tput, ..., issue 49's goals, and the reason for every missing figure).
A system that fails to start or to serve gets nulls and its reason; peer.py goes on with the next.
Exit status: 0 when every system produced every figure, 1 otherwise. docs/peer-bench.md: setups.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path

from machine_info import cpu_name
from peer_client import Workload, run_workloads
from peer_report import SystemResult, format_table, result
from peer_systems import REPO, StartConfig, SystemSpec, SystemStartError, running


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--system", action="append", required=True, metavar="NAME=KIND:ARG",
                   help="launch:colocated | launch:pd | launch:'<pd.sh flags>' | cmd:'<command>' | url:URL "
                        "(repeatable, run in order; see bench/peer_systems.py)")
    p.add_argument("--model-path", default=None, help="HF checkpoint dir (default: the default model, converted)")
    p.add_argument("--dtype", default="bfloat16", help="passed to pd.sh (cmd systems set their own)")
    p.add_argument("--launch-args", default="", help="extra pd.sh flags for every launch system")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--b1-prompts", type=int, default=16)
    p.add_argument("--c16-prompts", type=int, default=64)
    p.add_argument("--c16-concurrency", type=int, default=16)
    p.add_argument("--warmup", type=int, default=None,
                   help="warmup requests per workload (default: the workload's concurrency)")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds a system may take to serve")
    p.add_argument("--stop-timeout", type=float, default=60.0, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("--client-timeout", type=float, default=1800.0,
                   help="seconds the client may take for all workloads of one system")
    p.add_argument("--log-dir", type=Path, default=None, help="default: ./logs/peer-<time>")
    p.add_argument("--output-file", type=Path, help="also write the RESULT json here")
    args = p.parse_args(argv)
    for n in ("input_len", "output_len", "b1_prompts", "c16_prompts", "c16_concurrency"):
        if getattr(args, n) < 1:
            p.error(f"--{n.replace('_', '-')} must be >= 1")
    try:
        args.specs = [SystemSpec.parse(s) for s in args.system]
    except ValueError as e:
        p.error(str(e))
    if len({s.name for s in args.specs}) != len(args.specs):
        p.error("--system names must be distinct")
    return args


def workloads(args: argparse.Namespace) -> list[Workload]:
    def warm(concurrency: int) -> int:
        return concurrency if args.warmup is None else args.warmup

    return [Workload("b1", args.b1_prompts, 1, args.input_len, args.output_len, warm(1), seed=1),
            Workload("c16", args.c16_prompts, args.c16_concurrency, args.input_len, args.output_len,
                     warm(args.c16_concurrency), seed=2)]


def model_path(arg: str | None) -> str:
    from common.model.default_model import resolve_model_path

    return resolve_model_path(arg)


def measure(spec: SystemSpec, cfg: StartConfig, work: list[Workload], client_timeout_s: float) -> SystemResult:
    """Start, measure, stop one system; every failure ends up as a reason in the result."""
    res = SystemResult(spec.name, f"{spec.kind}:{spec.arg}", load_before=round(os.getloadavg()[0], 2))
    t0 = time.monotonic()
    print(f"peer: [{spec.name}] starting {res.spec}", file=sys.stderr, flush=True)
    try:
        with running(spec, cfg) as r:
            res.url = r.url
            print(f"peer: [{spec.name}] serving {r.model} at {r.url} after {time.monotonic() - t0:.0f} s; "
                  f"running {', '.join(w.name for w in work)}", file=sys.stderr, flush=True)
            res.outcomes = run_workloads(r.url, r.model, cfg.model_path, work, cfg.log_dir / f"{spec.name}-client",
                                         client_timeout_s)
    except SystemStartError as e:
        res.error = f"did not start: {e}"
    except Exception as e:  # noqa: BLE001 - one system's failure is reported, the others still run
        res.error = f"{type(e).__name__}: {e}"
    print(f"peer: [{spec.name}] done in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C: the running system and the client are stopped on the way out
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    log_dir = (args.log_dir or REPO / "logs" / f"peer-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    cfg = StartConfig(model_path(args.model_path), args.dtype, shlex.split(args.launch_args), args.ready_timeout,
                      args.stop_timeout, log_dir)
    work = workloads(args)
    systems = [measure(spec, cfg, work, args.client_timeout) for spec in args.specs]
    names = [w.name for w in work]
    res = result(systems, names)
    res["machine"] = {"cpu": cpu_name(), "cpus": os.cpu_count()}
    res["config"] = {"model_path": cfg.model_path, "dtype": args.dtype, "input_len": args.input_len,
                     "output_len": args.output_len, **{w.name: {"prompts": w.num_prompts, "concurrency": w.concurrency,
                                                                "warmup": w.warmup} for w in work}}
    print(format_table(systems, names, res))
    print(f"logs: {log_dir}")
    if args.output_file:
        args.output_file.write_text(json.dumps(res, indent=2) + "\n")
    print("RESULT " + json.dumps(res), flush=True)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
