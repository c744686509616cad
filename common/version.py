"""pdserve's version, with one source of truth: pyproject.toml's `[project] version`.

A source checkout (pyproject.toml beside the packages) reads that file, so the version never lags
an edit; an installed wheel reads its own metadata (importlib.metadata), which the build copied
from the same field. Every role's `--version` and `pdserve --version` print `version_line(role)`.
"""

from __future__ import annotations

import argparse
import re
from importlib import metadata
from pathlib import Path

DIST_NAME = "pdserve"
_PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
_VERSION_LINE = re.compile(r'^version\s*=\s*"([^"]+)"\s*$', re.MULTILINE)


def _from_pyproject(path: Path) -> str | None:
    """The [project] version of pdserve's own pyproject.toml, or None (not pdserve's, or none)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return None
    project = text.partition("[project]")[2].split("\n[", 1)[0]  # the [project] table alone
    if not re.search(rf'^name\s*=\s*"{DIST_NAME}"\s*$', project, re.MULTILINE):
        return None
    m = _VERSION_LINE.search(project)
    return m.group(1) if m else None


def _find_version() -> str:
    in_checkout = _from_pyproject(_PYPROJECT)
    if in_checkout is not None:
        return in_checkout
    try:
        return metadata.version(DIST_NAME)
    except metadata.PackageNotFoundError:
        return "0+unknown"  # neither installed nor a checkout (a copied tree): say so, never guess


__version__ = _find_version()


def version_line(role: str | None = None) -> str:
    """What `--version` prints: `pdserve 0.1.0`, or `pdserve 0.1.0 (router)` for one role."""
    return f"{DIST_NAME} {__version__}" + (f" ({role})" if role else "")


def add_version_flag(parser: argparse.ArgumentParser, role: str | None = None) -> None:
    """`--version`: print version_line(role) and exit 0 (argparse's own action)."""
    parser.add_argument("--version", action="version", version=version_line(role),
                        help="print pdserve's version and exit")
