"""The client side of bench/peer.py: SGLang's own bench_serving, the same for every system.

One client process per system runs its workloads one after the other (importing the client
costs ~13 s of CPU: paid once per system, not per workload), each through the client's own
command line (`cli_main`, as `python -m sglang.bench_serving` runs it), with its own warmup.
The client is SGLang's wheel as tests/compat/sglang_bench.py obtains it. The process is
bounded by a timeout and killed with its whole group past it; a workload that fails leaves a
reason instead of figures, and the other workloads still run.

Owns: the Workload record, the client's argv, the Figures read back from its JSONL output.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import msgspec

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.compat.sglang_bench import DRIVER, bench_serving_root  # noqa: E402

BACKEND = "sglang-oai"  # /v1/completions, streamed, ignore_eos on: what every OpenAI server serves


@dataclass(frozen=True)
class Workload:
    """One bench_serving run: `num_prompts` random-ids prompts of exactly `input_len` tokens, each
    asking for exactly `output_len` tokens, all arriving at once, at most `concurrency` in flight."""

    name: str
    num_prompts: int
    concurrency: int
    input_len: int
    output_len: int
    warmup: int  # warmup requests (at the same concurrency), not measured
    seed: int  # distinct per workload: no prompt of one is a cached prefix in the next


class Figures(msgspec.Struct):
    """The fields of bench_serving's result line that peer.py reports (SGLang's names, ms and tok/s)."""

    completed: int
    duration: float
    output_throughput: float
    median_ttft_ms: float
    p99_ttft_ms: float
    median_tpot_ms: float
    median_itl_ms: float
    p99_itl_ms: float
    total_output_tokens: int


@dataclass(frozen=True)
class Outcome:
    """One workload on one system: figures, or why there are none (a run with failed requests
    has none: its throughput would not compare)."""

    figures: Figures | None
    error: str | None = None


def client_argv(w: Workload, url: str, model: str, tokenizer: str, out: Path, request_timeout_s: float) -> list[str]:
    return ["--backend", BACKEND, "--base-url", url, "--model", model, "--tokenizer", tokenizer,
            "--dataset-name", "random-ids", "--random-input-len", str(w.input_len),
            "--random-output-len", str(w.output_len), "--random-range-ratio", "1",
            "--num-prompts", str(w.num_prompts), "--max-concurrency", str(w.concurrency),
            "--request-rate", "inf", "--warmup-requests", str(w.warmup), "--seed", str(w.seed),
            "--ready-check-timeout-sec", str(int(max(1, request_timeout_s))),
            "--output-file", str(out / f"{w.name}.jsonl"), "--disable-tqdm"]


def run_workloads(url: str, model: str, tokenizer: str, workloads: list[Workload], out: Path,
                  timeout_s: float) -> dict[str, Outcome]:
    """Every workload against `url` in one client process (at most `timeout_s` in all).
    Never raises for a failed run: each workload gets figures or an error."""
    out.mkdir(parents=True, exist_ok=True)
    try:
        root = bench_serving_root()
    except (subprocess.SubprocessError, OSError) as e:
        return {w.name: Outcome(None, f"no SGLang bench_serving client: {e}") for w in workloads}
    argvs = {w.name: client_argv(w, url, model, tokenizer, out, timeout_s) for w in workloads}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    for w in workloads:
        for suffix in (".jsonl", ".status"):
            (out / f"{w.name}{suffix}").unlink(missing_ok=True)
    log = out / "client.log"
    with log.open("wb") as f:
        proc = subprocess.Popen([sys.executable, "-c", DRIVER, json.dumps(argvs)], env=env, cwd=out, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the client and anything it left behind
            except ProcessLookupError:
                pass
            proc.wait(10)
    return {w.name: _outcome(w, out, log, timed_out, timeout_s) for w in workloads}


def _outcome(w: Workload, out: Path, log: Path, timed_out: bool, timeout_s: float) -> Outcome:
    status, result = out / f"{w.name}.status", out / f"{w.name}.jsonl"
    if not status.exists():
        why = f"client ran past {timeout_s:.0f} s" if timed_out else "client exited before it"
        return Outcome(None, f"{why}; last client output: {_tail(log)}")
    text = status.read_text()
    if text != "ok":
        return Outcome(None, f"bench_serving failed: {_last_line(text)}; last client output: {_tail(log)}")
    try:
        # Python's json: the line holds Infinity (an infinite request rate)
        figures = msgspec.convert(json.loads(result.read_text().splitlines()[-1]), Figures)
    except (OSError, IndexError, ValueError, msgspec.ValidationError) as e:
        return Outcome(None, f"no result line in {result} ({e}); last client output: {_tail(log)}")
    if figures.completed < w.num_prompts:
        return Outcome(None, f"{w.num_prompts - figures.completed} of {w.num_prompts} requests failed; "
                                f"last client output: {_tail(log)}")
    return Outcome(figures)


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "(nothing)"


def _tail(log: Path, n: int = 400) -> str:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return " | ".join(ln.strip() for ln in text[-n:].splitlines() if ln.strip())

