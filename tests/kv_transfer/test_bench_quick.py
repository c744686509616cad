"""bench/transfer.py --quick runs end to end and ends with its RESULT line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_transfer_bench_quick() -> None:
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "transfer.py"), "--quick"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
    )
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, out[-2000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith("RESULT ")
    result = json.loads(last[len("RESULT ") :])
    assert result["ratio_vs_memcpy_16mib_scattered"] > 0
    assert result["descriptors_per_request"] <= 4 and result["request_vs_memcpy"] > 0
    assert result["decode_stats"]["transfers"] == 12 and result["decode_stats"]["failures"] == {}
