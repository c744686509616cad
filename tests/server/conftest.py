"""Fixtures for frontend tests: the tiny checkpoint's tokenizer and real instance processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.server.server_procs import ServerProcess


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_llama_path: str) -> Path:
    return Path(tiny_llama_path)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def start_server(tiny_model_dir: Path) -> Iterator[Any]:
    """Factory: start_server(*extra_flags, healthy=True) -> ServerProcess; all stopped at teardown."""
    started: list[ServerProcess] = []

    def _start(*extra: str, healthy: bool = True) -> ServerProcess:
        server = ServerProcess(tiny_model_dir, *extra)
        started.append(server)
        if healthy:
            server.wait_healthy()
        return server

    try:
        yield _start
    finally:
        for server in started:
            server.stop()
