"""bench/soak.py's short mode against the shared tiny 1P1D cluster (no process of its own).

Runs the soak's main in this process for a few seconds of every kind of traffic and checks
what it reports from the real roles: every request judged ok, every kind sent, each role's
processes sampled, the pools whole at idle, no worker marked DOWN."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import soak
from soak_traffic import MIX

from tests.router.router_procs import ADMIN_KEY


def test_short_soak_reports_every_kind_and_whole_pools(
    tiny_cluster: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = tmp_path / "admin.key"
    key.write_text(ADMIN_KEY)
    pair = tiny_cluster.pair
    out = tmp_path / "soak.json"
    rc = soak.main([
        "--base-url", tiny_cluster.router.url, "--admin-api-key-file", str(key),
        "--roles", f"router={tiny_cluster.router.child.pid}", f"prefill={pair.prefill.child.pid}",
        f"decode={pair.decode.child.pid}",
        "--duration", "6", "--min-requests", "24", "--max-duration", "60", "--rate", "8", "--max-concurrency", "4",
        "--sample-interval", "1", "--slope-after", "0", "--min-words", "4", "--max-words", "24",
        "--min-out", "2", "--max-out", "6", "--request-timeout", "60", "--idle-timeout", "30",
        "--output-file", str(out),
    ])
    assert rc == 0
    last = capsys.readouterr().out.rstrip("\n").splitlines()[-1]
    assert last.startswith("RESULT ")
    result = json.loads(last.removeprefix("RESULT "))
    assert result["failed"] == 0, result["failures"]
    assert result["requests"] >= 24
    assert set(result["by_kind"]) == set(MIX), result["by_kind"]
    assert result["pools_idle_ok"] and set(result["pools_idle"]) == {pair.prefill.url, pair.decode.url}
    assert result["down_transitions"] == 0 and result["sample_errors"] == 0
    roles = {k.split("/")[0] for k in result["rss_mib_per_1000_requests"]}
    assert roles == {"router", "prefill", "decode"}
    assert all(lo > 0 for lo, _ in result["fds_min_max"].values())
    saved = json.loads(out.read_text())
    assert len(saved["outcomes"]) == result["requests"] and saved["samples"][-1]["workers"]
    tiny_cluster.wait_whole()
