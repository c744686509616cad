"""Shared fixtures: tiny random checkpoints (built once per session) and the real default model.

Stable names, used across test packages:
    tiny_checkpoint(arch) -> str       factory, arch in llama | qwen2 | qwen3 | mistral
    tiny_llama_path, tiny_qwen2_path, tiny_qwen3_path, tiny_mistral_path -> str
    default_model_path -> str          SmolLM2-135M-Instruct converted into the user cache
                                       (converted once per machine, ~12 s the first time)
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from common.model.testing import build_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    built: dict[str, str] = {}

    def make(arch: str) -> str:
        if arch not in built:
            built[arch] = str(build_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny-{arch}"), arch))
        return built[arch]

    return make


@pytest.fixture(scope="session")
def tiny_llama_path(tiny_checkpoint: Callable[[str], str]) -> str:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="session")
def tiny_qwen2_path(tiny_checkpoint: Callable[[str], str]) -> str:
    return tiny_checkpoint("qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_path(tiny_checkpoint: Callable[[str], str]) -> str:
    return tiny_checkpoint("qwen3")


@pytest.fixture(scope="session")
def tiny_mistral_path(tiny_checkpoint: Callable[[str], str]) -> str:
    return tiny_checkpoint("mistral")


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from common.model.default_model import resolve_model_path

    return resolve_model_path(None)
