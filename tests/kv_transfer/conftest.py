# ruff: noqa: E402
"""Fixtures: one prefill worker process per module (the survivor of failure tests) and an
in-process decode manager driven like a scheduler. Processes are always killed."""

from __future__ import annotations

import sys
from pathlib import Path

# tests/ is on sys.path (rootdir conftest), so tests/kv_transfer would shadow the real
# package as a namespace package; the repo root first makes `kv_transfer` the real one.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from collections.abc import Iterator

import pytest

from kv_transfer import AuxSlotAllocator
from tests.kv_transfer.harness import DecodeSide, Driver, PageAlloc, PoolSpec, Worker, make_manager


@pytest.fixture(scope="module")
def prefill() -> Iterator[Worker]:
    worker = Worker("prefill", PoolSpec(), seed=1)
    try:
        yield worker
    finally:
        worker.stop()


@pytest.fixture(scope="module")
def decode() -> Iterator[DecodeSide]:
    spec = PoolSpec()
    mgr, pool, aux = make_manager("decode", spec, None, drain_timeout_s=3.0, transfer_timeout_s=3.0)
    try:
        yield DecodeSide(mgr, Driver(mgr), aux, AuxSlotAllocator(spec.aux_slots), PageAlloc(spec.num_pages), pool)
    finally:
        mgr.shutdown()
        assert not mgr._thread.is_alive(), "decode manager thread did not stop"
