"""Every repository path the docs name exists: the architecture page's "file that owns it", the
design notes' code references and the README's links keep up when code moves or is renamed."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOP = r"(?:common|router|prefill_server|decode_server|kv_transfer|launch|bench|tests|deploy|tools|docs)"
# `a/b/c` in backticks, or a bare path with a file extension (so prose like "launch/collect" is not one)
_PATH = re.compile(rf"`({TOP}/[\w./-]*\w/?)`|(?<![\w./-])({TOP}/[\w./-]*\.(?:py|sh|md|yaml|json|c))\b")


def doc_files() -> list[Path]:
    return sorted((REPO / "docs").rglob("*.md")) + [REPO / "README.md", REPO / "CHANGELOG.md"]


def named_paths(text: str) -> list[str]:
    return [m.group(1) or m.group(2) for m in _PATH.finditer(text)]


def test_named_paths_exist() -> None:
    missing = [f"{doc.relative_to(REPO)}: {p}" for doc in doc_files() for p in named_paths(doc.read_text())
               if not (REPO / p).exists()]
    assert not missing, "the docs name paths that do not exist:\n" + "\n".join(missing)


def test_the_check_sees_paths() -> None:
    """The pattern finds what the pages name (so the test above is not vacuous), and flags a renamed file."""
    arch = named_paths((REPO / "docs" / "architecture.md").read_text())
    assert {"router/dispatcher.py", "common/cache/radix_cache.py", "decode_server/scheduler.py",
            "kv_transfer/nixl_endpoint.py", "common/scheduler/new_token_ratio.py"} <= set(arch)
    assert named_paths("owned by `router/no_such_file.py` and common/nothing_here.py; launch/collect") == [
        "router/no_such_file.py", "common/nothing_here.py"]
    assert not (REPO / "router/no_such_file.py").exists()
