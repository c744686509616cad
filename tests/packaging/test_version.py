"""One version, from pyproject.toml: common.version reads it in a checkout, every role's `--version`
and `pdserve --version` print it, and `pdserve ROLE` dispatches to the role's own entry point."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import tomllib

from common import cli, version
from common.server.server_args import parse_server_args
from router.config import build_parser

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def test_version_is_pyprojects() -> None:
    assert version.__version__ == PYPROJECT["project"]["version"]
    assert re.fullmatch(r"\d+\.\d+\.\d+([.+-]\w+)*", version.__version__)


def test_pyproject_reader_refuses_another_projects_file(tmp_path: Path) -> None:
    other = tmp_path / "pyproject.toml"
    other.write_text('[project]\nname = "other"\nversion = "9.9.9"\n')
    assert version._from_pyproject(other) is None
    other.write_text('[tool.x]\nversion = "1"\n[project]\nname = "pdserve"\nversion = "2.3.4"\n[tool.y]\nversion = "5"\n')
    assert version._from_pyproject(other) == "2.3.4"
    assert version._from_pyproject(tmp_path / "missing.toml") is None


@pytest.mark.parametrize("parse,role", [
    (lambda a: build_parser().parse_args(a), "router"),
    (lambda a: parse_server_args(a, disaggregation_mode="prefill"), "prefill"),
    (lambda a: parse_server_args(a, disaggregation_mode="decode"), "decode"),
    (lambda a: parse_server_args(a), "server"),
    (lambda a: cli.build_parser().parse_args(a), None),
])
def test_every_parser_prints_the_version(parse, role: str | None, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse(["--version"])  # no --model-path: --version needs nothing else
    assert exit_.value.code == 0
    suffix = f" ({role})" if role else ""
    assert capsys.readouterr().out == f"pdserve {version.__version__}{suffix}\n"


def test_every_role_has_its_console_script_and_module() -> None:
    scripts = PYPROJECT["project"]["scripts"]
    assert scripts["pdserve"] == "common.cli:main"
    for name, role in cli.ROLES.items():
        assert scripts[role.script] == f"{role.module}.__main__:main", name


def test_pdserve_dispatches_to_the_role(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    import decode_server.__main__ as decode_main

    monkeypatch.setattr(decode_main, "main", seen.append)
    monkeypatch.setattr(sys, "argv", ["pdserve", "decode", "--port", "1", "--model-path", "m"])
    cli.main(["decode", "--port", "1", "--model-path", "m"])
    assert seen == [["--port", "1", "--model-path", "m"]]
    assert sys.argv[0] == "pdserve-decode"

