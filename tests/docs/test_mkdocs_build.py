"""The docs site builds with `mkdocs build --strict`: a broken link, a missing page or a page
left out of the nav fails here (in process, into a temporary directory)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    from mkdocs.commands.build import build
    from mkdocs.config import load_config
    from mkdocs.exceptions import Abort

    cfg = load_config(str(REPO / "mkdocs.yml"), site_dir=str(tmp_path / "site"), strict=True)
    try:
        build(cfg)
    except Abort as e:  # strict: warnings (broken links, pages not in the nav) abort the build
        pytest.fail(f"mkdocs build --strict failed: {e}")
    assert (tmp_path / "site" / "index.html").exists()
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").exists()


def test_mkdocs_strict_catches_a_broken_link(tmp_path: Path) -> None:
    """The check above can fail: the same build over a copy of the docs with one broken link aborts."""
    import shutil

    from mkdocs.commands.build import build
    from mkdocs.config import load_config
    from mkdocs.exceptions import Abort

    docs = tmp_path / "docs"
    shutil.copytree(REPO / "docs", docs)
    page = docs / "getting-started.md"
    page.write_text(page.read_text() + "\nSee [nowhere](no-such-page.md).\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text((REPO / "mkdocs.yml").read_text())
    cfg = load_config(str(config), site_dir=str(tmp_path / "site"), strict=True)
    with pytest.raises(Abort):
        build(cfg)
