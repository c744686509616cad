"""Fixtures of the launch tests: `launches`, the pd.sh runs a test started, stopped after it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.launch.pd_launch import PdLaunch


@pytest.fixture
def launches() -> Iterator[list[PdLaunch]]:
    started: list[PdLaunch] = []
    try:
        yield started
    finally:
        for run in started:
            run.kill_leftovers()
