"""Which UCX transports carried the KV, read from the tables UCX_PROTO_INFO=y prints.

    python bench/gpu/ucx_transports.py LOG...    -> one line: "cuda_ipc x2 (...)" or "none logged"

UCX prints one table per (endpoint config, operation, memory types), each line of it prefixed
with UCX's own log prefix ("[time] [host:pid:tid]"). The UCX bundled with nixl-cu13 1.5.1 puts
the config and the operation on two lines, cuts the operation at the table's width, and has a
column-header row before the rows:

    +--------+-------------+-----------------------------------+
    | prefill-vm-14749-d206a6a6 self cfg#0                     |
    | remote memory write by ucp_put* from host memory to host |
    +--------+-------------+-----------------------------------+
    | Range  | Description |              Config               |
    +--------+-------------+-----------------------------------+
    | 0..inf | zero-copy   | cma/memory                        |
    +--------+-------------+-----------------------------------+

(older UCX: one header line "| config | operation |", no column-header row). So the first
protocol row is 4 lines below the operation and every later row beyond the old `grep -A4`
window: a cuda_ipc zero-copy row after a cuda_copy short row was never seen. This parses whole
tables and counts the transports of every `remote memory write` (NIXL's WRITE = ucp_put) table
involving GPU memory (the KV pool), apart from the rest (the aux rows' host writes, AM).
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

_CELL_LINE = re.compile(r"\|(.*)\|\s*$")
_TRANSPORT = re.compile(r"\b([a-z][a-z0-9_]*)/\S+")


@dataclass
class ProtoTable:
    """One UCX protocol table: its header (config | operation) and its rows' transports."""

    config: str
    operation: str
    transports: list[str] = field(default_factory=list)

    @property
    def kv_write(self) -> bool:
        """A put to GPU memory: how NIXL WRITEs the KV into decode's pool."""
        op = self.operation  # UCX cuts it at the table's width: "... from cuda/GPU0 to cu"
        return "remote memory write" in op and ("cuda" in op or re.search(r" to cu\S*$", op) is not None)


def _body(line: str) -> str:
    """The table part of a log line (from its first '|'); '' for separators and other lines."""
    i = line.find("|")
    return line[i:] if i >= 0 else ""


def parse_tables(text: str) -> list[ProtoTable]:
    """Every protocol table in `text` (one process's log; lines of other output in between
    are skipped)."""
    tables: list[ProtoTable] = []
    current: ProtoTable | None = None
    for line in text.splitlines():
        body = _body(line)
        if not body:
            continue
        cells_m = _CELL_LINE.match(body.strip())
        if not cells_m:
            continue
        cells = [c.strip() for c in cells_m.group(1).split("|")]
        if len(cells) == 2 and " by " in cells[1]:  # one header line: config | operation
            current = ProtoTable(cells[0], cells[1])
            tables.append(current)
        elif len(cells) == 1 and " by " in cells[0] and current is not None and not current.operation:
            current.operation = cells[0]  # two header lines: the operation after the config
        elif len(cells) == 1:  # two header lines: the config first
            current = ProtoTable(cells[0], "")
            tables.append(current)
        elif len(cells) >= 3 and current is not None:  # row: range | protocol | transport(s)
            current.transports.extend(_TRANSPORT.findall(cells[-1]))
    return tables


def summarize(tables: list[ProtoTable]) -> str:
    """'kv: cuda_ipc x2 (from cuda/dev[0] to cuda/dev[0]); other: cma x4' or 'none logged'."""
    kv = Counter(t for tab in tables if tab.kv_write for t in tab.transports)
    other = Counter(t for tab in tables if not tab.kv_write for t in tab.transports)
    if not tables:
        return "none logged (no UCX_PROTO_INFO table in the logs)"
    ops = sorted({tab.operation.split(" from ", 1)[-1] for tab in tables if tab.kv_write})
    fmt = lambda c: ",".join(f"{k} x{v}" for k, v in sorted(c.items())) or "none"  # noqa: E731
    return f"kv: {fmt(kv)} ({'; '.join(ops) or 'no put to cuda'}); other: {fmt(other)}"


def main(paths: list[str]) -> int:
    tables = [t for p in paths if Path(p).is_file() for t in parse_tables(Path(p).read_text(errors="replace"))]
    print(summarize(tables))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
