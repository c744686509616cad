"""What the benches print beside every figure: the CPU's model name."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_name() -> str:
    """/proc/cpuinfo's model name; platform's guess where that file is missing."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"
