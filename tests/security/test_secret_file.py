"""Router keys from files (common.secret_file): the file wins over the environment, a flag and its
file together or an empty file are refused, and a key on argv still works but is logged."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from common.secret_file import SecretFileError, resolve_secret
from router.config import RouterConfig


def _cfg(model: str, *extra: str) -> RouterConfig:
    return RouterConfig.from_args(["--model-path", model, "--decode", "http://127.0.0.1:1",
                                   "--prefill", "http://127.0.0.1:2", *extra])


def test_keys_from_files_env_and_argv(tiny_llama_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      caplog: pytest.LogCaptureFixture) -> None:
    key, admin = tmp_path / "key", tmp_path / "admin"
    key.write_text("file-key\n")
    admin.write_text("file-admin")
    key.chmod(0o600)
    admin.chmod(0o644)
    monkeypatch.setenv("PDSERVE_API_KEY", "env-key")
    with caplog.at_level(logging.WARNING, logger="pdserve.secrets"):
        cfg = _cfg(tiny_llama_path, "--api-key-file", str(key), "--admin-api-key-file", str(admin))
    assert (cfg.api_key, cfg.admin_api_key) == ("file-key", "file-admin")
    assert "readable by other users" in caplog.text and str(admin) in caplog.text and "file-key" not in caplog.text
    assert _cfg(tiny_llama_path).api_key == "env-key"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pdserve.secrets"):
        assert _cfg(tiny_llama_path, "--api-key", "argv-key").api_key == "argv-key"
    assert "visible to every user in `ps`" in caplog.text


def test_refused_secret_sources(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(SecretFileError, match="is empty"):
        resolve_secret("--api-key", None, str(empty), "X")
    with pytest.raises(SecretFileError, match="cannot read"):
        resolve_secret("--api-key", None, str(tmp_path / "missing"), "X")
    with pytest.raises(SecretFileError, match="not both"):
        resolve_secret("--api-key", "k", str(empty), "X")
