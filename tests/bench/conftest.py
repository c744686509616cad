"""Fixtures for bench tests (helpers in bench_fakes.py, which also puts bench/ on sys.path).

    tiny_tokenizer_dir -> str         the tiny checkpoints' tokenizer alone (no weights: faster)
    fake_server(name) -> FakeServer   one process per name per session, reaped at the end
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.bench.bench_fakes import FakeServer


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from common.model.testing import build_tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tiny_tokenizer().save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="session")
def fake_server(tiny_tokenizer_dir: str) -> Iterator[Callable[[str], FakeServer]]:
    servers: dict[str, FakeServer] = {}

    def get(name: str) -> FakeServer:
        if name not in servers:
            servers[name] = FakeServer(tiny_tokenizer_dir)
        return servers[name]

    try:
        yield get
    finally:
        for s in servers.values():
            s.stop()
