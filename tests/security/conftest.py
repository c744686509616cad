"""Fixtures of the front-door attack tests: a tiny checkpoint with a long context (so a stream can
outlast any socket buffer), shared by every module here."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.model.testing import build_tiny_checkpoint

LONG_CONTEXT = 1 << 16


@pytest.fixture(scope="session")
def long_ctx_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("security-model") / "tiny-long",
                                 max_position_embeddings=LONG_CONTEXT)
