"""Output of bench/serving.py: stdout tables, the JSON file and the PNG (matplotlib, Agg).

A run is one (label, RunReport); a plain run has one, --compare several (same workload).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from serving_client import RequestRecord
from serving_metrics import Summary, throughput_timeline


@dataclass
class RunReport:
    label: str
    base_url: str
    model: str | None
    summary: Summary
    records: list[RequestRecord]

    def to_dict(self) -> dict[str, Any]:
        recs = []
        for r in self.records:
            d = asdict(r)
            d["tpot"] = r.tpot
            recs.append(d)
        return {"label": self.label, "base_url": self.base_url, "model": self.model,
                "summary": self.summary.to_dict(), "throughput_timeline": throughput_timeline(self.records),
                "records": recs}


def _fmt(v: float | int | None, digits: int = 2) -> str:
    if v is None:
        return "-"
    return str(v) if isinstance(v, int) else f"{v:.{digits}f}"


def _rows(s: Summary) -> list[tuple[str, str]]:
    rows = [
        ("Duration (s)", _fmt(s.duration_s)),
        ("Completed requests", _fmt(s.completed)),
        ("Failed requests", _fmt(s.failed)),
        ("Total input tokens", _fmt(s.total_input_tokens)),
        ("Total output tokens", _fmt(s.total_output_tokens)),
        ("Request throughput (req/s)", _fmt(s.request_throughput)),
        ("Input throughput (tok/s)", _fmt(s.input_throughput)),
        ("Output throughput (tok/s)", _fmt(s.output_throughput)),
        ("Total throughput (tok/s)", _fmt(s.total_throughput)),
        ("Goodput (req/s)", _fmt(s.goodput)),
    ]
    for name, st in (("TTFT", s.ttft), ("TPOT", s.tpot), ("ITL", s.itl), ("E2E", s.e2e)):
        rows += [(f"{name} {k} (ms)", _fmt(getattr(st, attr))) for k, attr in _STAT_ROWS]
    return rows


_STAT_ROWS = (("mean", "mean"), ("median", "median"), ("p90", "p90"), ("p99", "p99"))


def format_table(runs: Sequence[RunReport], title: str) -> str:
    """One column per run; failures' error texts listed below the table."""
    cols = [[v for _, v in _rows(r.summary)] for r in runs]
    names = [k for k, _ in _rows(runs[0].summary)]
    w0 = max(len(n) for n in names)
    widths = [max(12, len(r.label), *(len(v) for v in c)) for r, c in zip(runs, cols, strict=True)]
    width = w0 + sum(w + 2 for w in widths)
    lines = [f" {title} ".center(width, "="), " " * w0 + "".join(f"  {r.label:>{w}}" for r, w in
                                                                   zip(runs, widths, strict=True))]
    for i, n in enumerate(names):
        lines.append(f"{n:<{w0}}" + "".join(f"  {c[i]:>{w}}" for c, w in zip(cols, widths, strict=True)))
    lines.append("=" * width)
    for r in runs:
        for err, count in r.summary.errors.items():
            lines.append(f"[{r.label}] {count} x {err}")
    return "\n".join(lines)


def write_json(path: str | Path, config: dict[str, Any], runs: Sequence[RunReport],
               extra: dict[str, Any] | None = None) -> None:
    """Single run: {config, summary, records, ...}; compare: {config, labels, runs: {label: ...}, ...}."""
    if len(runs) == 1:
        doc = {"config": config, **runs[0].to_dict()}
    else:
        doc = {"config": config, "labels": [r.label for r in runs],
               "runs": {r.label: r.to_dict() for r in runs}}
    doc.update(extra or {})
    Path(path).write_text(json.dumps(doc, indent=1, default=str))


def _cdf(ax: Any, values_ms: list[float], label: str) -> None:
    if not values_ms:
        return
    xs = sorted(values_ms)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=label)


def write_plot(path: str | Path, runs: Sequence[RunReport]) -> None:
    """2x2: TTFT, TPOT and E2E CDFs, output tokens/s per 1 s bucket; one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = (("TTFT (ms)", lambda r: r.ttft), ("TPOT (ms)", lambda r: r.tpot),
              ("E2E latency (ms)", lambda r: r.e2e))
    for ax, (name, get) in zip(axes.flat[:3], panels, strict=True):
        for run in runs:
            vals = [v * 1e3 for r in run.records if r.success and (v := get(r)) is not None]
            _cdf(ax, vals, run.label)
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{name.split(' (')[0]} CDF")
        ax.grid(alpha=0.3)
    ax = axes.flat[3]
    for run in runs:
        tl = throughput_timeline(run.records)
        ax.plot([i + 0.5 for i in range(len(tl))], tl, marker=".", label=run.label)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens / s")
    ax.set_title("Output throughput (1 s buckets)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    for a in axes.flat:
        if a.get_legend_handles_labels()[0]:
            a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

