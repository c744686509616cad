"""bench/peer.py's output: the table and the RESULT line, computed from the measured figures only.

Per system NAME and workload W (b1, c16) the RESULT has NAME_W_out_tok_s, NAME_W_ttft_p50_ms,
NAME_W_tpot_ms (p50), NAME_W_itl_p99_ms; a system or workload without figures has nulls there
and its reason under "errors". The ratios name systems by their --system names (`colocated`,
`pd`, `vllm`): each is null when a figure it needs is missing.

Owns: SystemResult (one system's outcome), the key names, the ratio and goal definitions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from peer_client import Figures, Outcome


class Metric(NamedTuple):
    key: str  # RESULT key suffix
    field: str  # Figures field
    header: str  # table column


METRICS = (
    Metric("out_tok_s", "output_throughput", "out tok/s"),
    Metric("ttft_p50_ms", "median_ttft_ms", "TTFT p50 ms"),
    Metric("tpot_ms", "median_tpot_ms", "TPOT p50 ms"),
    Metric("itl_p99_ms", "p99_itl_ms", "ITL p99 ms"),
)


class Ratio(NamedTuple):
    key: str
    num: str  # RESULT key of the numerator
    den: str


RATIOS = (
    Ratio("colocated_vs_vllm_c16_tput", "colocated_c16_out_tok_s", "vllm_c16_out_tok_s"),
    Ratio("pd_vs_colocated_c16_tput", "pd_c16_out_tok_s", "colocated_c16_out_tok_s"),
    Ratio("colocated_vs_vllm_b1_tpot", "colocated_b1_tpot_ms", "vllm_b1_tpot_ms"),
    Ratio("pd_vs_colocated_c16_itl_p99", "pd_c16_itl_p99_ms", "colocated_c16_itl_p99_ms"),
)


class Goal(NamedTuple):
    ratio: str
    op: str  # ">=" or "<="
    bound: float


# issue 49's targets
GOALS = (
    Goal("colocated_vs_vllm_c16_tput", ">=", 1.1),
    Goal("colocated_vs_vllm_b1_tpot", "<=", 0.9),
    Goal("pd_vs_colocated_c16_tput", ">=", 0.9),
    Goal("pd_vs_colocated_c16_itl_p99", "<=", 1.0),
)


@dataclass
class SystemResult:
    """One system's run: its spec as given, and per workload figures or a reason (a system that did
    not start has the start error for every workload)."""

    name: str
    spec: str
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    error: str | None = None  # the system did not start, or broke outside a workload
    url: str | None = None  # where it served
    load_before: float | None = None  # 1-min load average just before it started (others' load)

    def figures(self, workload: str) -> Figures | None:
        o = self.outcomes.get(workload)
        return o.figures if o is not None else None


def result(systems: list[SystemResult], workloads: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"systems": [s.name for s in systems]}
    errors: dict[str, str] = {}
    for s in systems:
        if s.error:
            errors[s.name] = s.error
        for w in workloads:
            f = s.figures(w)
            for m in METRICS:
                out[f"{s.name}_{w}_{m.key}"] = round(float(getattr(f, m.field)), 3) if f is not None else None
            o = s.outcomes.get(w)
            if o is not None and o.error:
                errors[f"{s.name}_{w}"] = o.error
            elif o is None and not s.error:
                errors[f"{s.name}_{w}"] = "not run"
    for r in RATIOS:
        num, den = out.get(r.num), out.get(r.den)
        out[r.key] = round(num / den, 4) if num is not None and den else None
    out["load_before"] = {s.name: s.load_before for s in systems}
    out["setups"] = {s.name: s.spec for s in systems}
    out["endpoints"] = {s.name: s.url for s in systems}
    out["goals"] = {f"{g.ratio}{g.op}{g.bound}": _met(out[g.ratio], g) for g in GOALS}
    out["errors"] = errors
    return out


def _met(value: float | None, g: Goal) -> bool | None:
    if value is None:
        return None
    return value >= g.bound if g.op == ">=" else value <= g.bound


# The table's columns (issue 49's table plus ITL p99); the RESULT line has every metric.
TABLE = (("b1", "tpot_ms"), ("b1", "ttft_p50_ms"), ("c16", "out_tok_s"), ("c16", "ttft_p50_ms"),
         ("c16", "tpot_ms"), ("c16", "itl_p99_ms"))


def format_table(systems: list[SystemResult], workloads: list[str], res: dict[str, Any]) -> str:
    by_key = {m.key: m for m in METRICS}
    cols = [(w, by_key[k]) for w, k in TABLE if w in workloads]
    header = ["system"] + [f"{w}: {m.header}" for w, m in cols] + ["load before"]
    rows = [[s.name] + [_cell(res[f"{s.name}_{w}_{m.key}"]) for w, m in cols] + [_cell(s.load_before, 2)]
            for s in systems]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.rjust(widths[i]) if i else c.ljust(widths[i]) for i, c in enumerate(r))
             for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += ["", "setups:"] + [f"  {s.name}: {s.spec}" for s in systems]
    ratios = [f"  {r.key} = {_cell(res[r.key], 3)}" for r in RATIOS]
    lines += ["", "ratios:", *ratios]
    if res["errors"]:
        lines += ["", "errors:"] + [f"  {k}: {_one_line(v)}" for k, v in res["errors"].items()]
    return "\n".join(lines)


def _one_line(text: str) -> str:
    return " | ".join(ln.strip() for ln in text.splitlines() if ln.strip())


def _cell(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"
