"""The prefill engine runs with a small oneDNN primitive cache (issue 41 item 6).

Prefill's chunks come in hundreds of lengths; with oneDNN's default cache (1,024 primitives)
the engine kept one primitive per linear and length and grew ~2.5 MiB per request. The fix is
ONEDNN_PRIMITIVE_CACHE_CAPACITY set by the prefill frontend before it spawns its engine
(prefill_server/onednn_cache.py). These tests check that a real prefill engine process starts
with it, that decode's does not, and that this torch's oneDNN honours it (a primitive built
again after eviction instead of a cache hit), the figures are in bench/prefill_memory.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from prefill_server.onednn_cache import (
    ENV_VAR,
    IDEEP_CAPACITY,
    IDEEP_ENV_VAR,
    PREFILL_CAPACITY,
    limit_primitive_cache,
)
from tests.pd.pd_procs import REPO_ROOT, RoleProcess

PROBE = """
import torch
from common.model.packed_linear import PackedLinear
lin = torch.nn.Linear(64, 32)
packed = PackedLinear(lin.weight, lin.bias)
for rows in (5, 6, 7, 5):
    packed(torch.randn(rows, 64))
"""


def engine_environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


@pytest.mark.parametrize(("module", "expected"), [
    ("prefill_server", {ENV_VAR: str(PREFILL_CAPACITY), IDEEP_ENV_VAR: str(IDEEP_CAPACITY)}),
    ("decode_server", {ENV_VAR: None, IDEEP_ENV_VAR: None}),
])
def test_the_prefill_engine_process_starts_with_a_small_primitive_cache(tiny_llama_path: str, module: str,
                                                                         expected: dict[str, str | None],
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.delenv(IDEEP_ENV_VAR, raising=False)
    role = RoleProcess(module, Path(tiny_llama_path), "--max-total-tokens", "2048")
    try:
        role.wait_healthy()
        environ = engine_environ(role.engine_pid())
        assert {name: environ.get(name) for name in expected} == expected
    finally:
        role.stop()


def test_a_capacity_the_user_exported_wins() -> None:
    env = {ENV_VAR: "8", IDEEP_ENV_VAR: "4"}
    assert limit_primitive_cache(env) == "8" and env == {ENV_VAR: "8", IDEEP_ENV_VAR: "4"}
    env = {}
    assert limit_primitive_cache(env) == str(PREFILL_CAPACITY)
    assert env == {ENV_VAR: str(PREFILL_CAPACITY), IDEEP_ENV_VAR: str(IDEEP_CAPACITY)}


@pytest.mark.parametrize(("capacity", "last_create"), [("2", "create:cache_miss"), ("1024", "create:cache_hit")])
def test_onednn_evicts_beyond_the_capacity(capacity: str, last_create: str) -> None:
    """Row counts 5, 6, 7, 5: with room for 2 primitives the second 5 is built again."""
    env = {**os.environ, ENV_VAR: capacity, "ONEDNN_VERBOSE": "2"}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    creates = [line.split(",")[3] for line in out.splitlines() if ",create:" in line and ",inner_product," in line]
    assert creates[:3] == ["create:cache_miss"] * 3
    assert creates[3] == last_create
