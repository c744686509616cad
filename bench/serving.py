"""Online serving benchmark against any OpenAI-compatible endpoint (router, instance, vLLM, SGLang).

    python bench/serving.py --base-url http://127.0.0.1:30000 --tokenizer MODEL_DIR \
        --dataset random --num-prompts 200 --random-input-len 512 --random-output-len 128 \
        --request-rate 8 --max-concurrency 64 --output-file out.json --plot out.png
    python bench/serving.py --backend native --base-url http://127.0.0.1:30001 ...   # one instance
    python bench/serving.py --compare 1p1d=http://127.0.0.1:30000 colo=http://127.0.0.1:31000 \
        --dataset generated-shared-prefix --tokenizer MODEL_DIR

Every request sends ignore_eos and max_tokens = its drawn output length. The workload is
built once from --seed, so --compare replays exactly the same prompts and arrival times on
each endpoint, one endpoint after the other. Last stdout line: RESULT {json} (RESULT_KEYS of
serving_metrics; with --compare one entry per label plus `<key>_ratio` = first / second).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path
from typing import Any, NamedTuple

import httpx
from serving_client import BACKENDS, StreamingClient, first_model_id
from serving_metrics import Slo, ratios, summarize
from serving_report import RunReport, format_table, write_json, write_plot
from serving_runner import LoadConfig, LoadRunner
from serving_workloads import (
    Workload,
    multi_turn_workload,
    random_workload,
    shared_prefix_workload,
    skewed_workload,
)

DATASETS = ("random", "generated-shared-prefix", "multi-turn", "skewed")


class Endpoint(NamedTuple):
    label: str
    url: str


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=BACKENDS, default="openai")
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--compare", nargs="+", metavar="LABEL=URL",
                   help="run the same workload on each endpoint, in order")
    p.add_argument("--model", help="default: first id of GET /v1/models (openai backends)")
    p.add_argument("--tokenizer", help="HF tokenizer dir; default: model_path from GET /server_info")
    p.add_argument("--dataset", choices=DATASETS, default="random")
    p.add_argument("--num-prompts", type=int, default=None, help="random: default 200; shared-prefix: a cap")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.5, help="also used for multi-turn lengths")
    p.add_argument("--gsp-num-groups", type=int, default=8)
    p.add_argument("--gsp-prompts-per-group", type=int, default=16)
    p.add_argument("--gsp-system-prompt-len", type=int, default=1024)
    p.add_argument("--gsp-question-len", type=int, default=64)
    p.add_argument("--gsp-output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=1,
                   help="--compare: run the workload this many times per endpoint, interleaved (round k "
                        "starts at endpoint k), and summarise each endpoint over all its rounds")
    p.add_argument("--mt-num-conversations", type=int, default=16)
    p.add_argument("--mt-turns", type=int, default=4)
    p.add_argument("--mt-question-len", type=int, default=64)
    p.add_argument("--mt-output-len", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson rate (req/s); inf: all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--extra-body", type=json.loads, default={},
                   help="JSON merged into each request body (native: into sampling_params)")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--output-file", help="JSON: config, summary, per-request records")
    p.add_argument("--plot", help="PNG: TTFT/TPOT/E2E CDFs and output tokens/s over time")
    args = p.parse_args(argv)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be >= 1")
    if not args.request_rate > 0:
        p.error("--request-rate must be > 0 (inf for all at once)")
    return args


def endpoints(args: argparse.Namespace) -> list[Endpoint]:
    if not args.compare:
        return [Endpoint("run", args.base_url)]
    out = []
    for item in args.compare:
        label, sep, url = item.partition("=")
        if not sep or not label or not url or label == "labels" or label.endswith("_ratio"):
            raise SystemExit(f"--compare wants LABEL=URL (label not 'labels' nor '*_ratio'), got {item!r}")
        out.append(Endpoint(label, url))
    if len({e.label for e in out}) != len(out):
        raise SystemExit("--compare labels must be distinct")
    return out


def load_tokenizer(args: argparse.Namespace, url: str) -> Any:
    path = args.tokenizer
    if path is None:
        try:
            info = httpx.get(url.rstrip("/") + "/server_info", timeout=10).raise_for_status().json()
            path = info["model_path"]
        except (httpx.HTTPError, ValueError, KeyError) as e:
            raise SystemExit(f"no tokenizer: {url}/server_info failed ({e}); pass --tokenizer") from e
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def build_workload(args: argparse.Namespace, tok: Any) -> Workload:
    if args.dataset == "random":
        return random_workload(tok, args.num_prompts or 200, args.random_input_len, args.random_output_len,
                               args.random_range_ratio, args.seed)
    if args.dataset == "skewed":  # prefix: --gsp-system-prompt-len, question: --gsp-question-len
        return skewed_workload(tok, args.num_prompts or 200, args.gsp_system_prompt_len, args.gsp_question_len,
                               args.random_input_len, args.random_output_len, args.random_range_ratio, args.seed)
    if args.dataset == "generated-shared-prefix":
        w = shared_prefix_workload(tok, args.gsp_num_groups, args.gsp_prompts_per_group,
                                   args.gsp_system_prompt_len, args.gsp_question_len, args.gsp_output_len,
                                   args.seed)
        w.requests = w.requests[: args.num_prompts] if args.num_prompts else w.requests
        return w
    return multi_turn_workload(tok, args.mt_num_conversations, args.mt_turns, args.mt_question_len,
                               args.mt_output_len, args.random_range_ratio, args.seed)


async def run_endpoint(args: argparse.Namespace, ep: Endpoint, workload: Workload, tok: Any) -> RunReport:
    model = args.model
    if model is None and args.backend != "native":
        model = await first_model_id(ep.url)
    cfg = LoadConfig(args.request_rate, args.max_concurrency, args.warmup_requests, args.seed,
                     args.disable_tqdm)
    async with StreamingClient(ep.url, args.backend, model, timeout=args.request_timeout,
                               extra_body=args.extra_body, tokenizer=tok) as client:
        res = await LoadRunner(client, cfg).run(workload)
    summary = summarize(res.records, res.duration, Slo(args.slo_ttft_ms, args.slo_tpot_ms))
    return RunReport(ep.label, ep.url, model, summary, res.records)


def merge_rounds(reports: list[RunReport], slo: Slo) -> RunReport:
    """One endpoint's rounds as one run: every record, the durations added."""
    if len(reports) == 1:
        return reports[0]
    records = [r for rep in reports for r in rep.records]
    summary = summarize(records, sum(rep.summary.duration_s for rep in reports), slo)
    first = reports[0]
    return RunReport(first.label, first.base_url, first.model, summary, records)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    eps = endpoints(args)
    tok = load_tokenizer(args, eps[0].url)
    workload = build_workload(args, tok)
    rounds: dict[str, list[RunReport]] = {ep.label: [] for ep in eps}
    for k in range(max(1, args.rounds)):
        for ep in eps[k % len(eps):] + eps[: k % len(eps)]:
            try:
                rounds[ep.label].append(asyncio.run(run_endpoint(args, ep, workload, tok)))
            except RuntimeError as e:
                print(f"error: [{ep.label}] {e}", file=sys.stderr)
                return 1
    runs = [merge_rounds(rounds[ep.label], Slo(args.slo_ttft_ms, args.slo_tpot_ms)) for ep in eps]
    title = f"Serving benchmark: {workload.name}, {workload.num_requests} requests, {args.backend}"
    print(format_table(runs, title))
    if len(runs) == 1:
        result: dict[str, Any] = runs[0].summary.result()
    else:
        result = {"labels": [r.label for r in runs], **{r.label: r.summary.result() for r in runs},
                  **ratios(runs[0].summary.result(), runs[1].summary.result())}
    config = dict(vars(args), num_requests=workload.num_requests,
                  request_rate=args.request_rate if math.isfinite(args.request_rate) else "inf")
    if args.output_file:
        write_json(args.output_file, config, runs, {"result": result})
        print(f"wrote {Path(args.output_file).resolve()}")
    if args.plot:
        write_plot(args.plot, runs)
        print(f"wrote {Path(args.plot).resolve()}")
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
