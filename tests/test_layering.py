"""Package layering, checked on the source: what may import what, and no untyped role state.

- common/scheduler and kv_transfer never import common/server (the server layer sits above);
- kv_transfer never imports common/scheduler (a transfer backend knows pages, not requests);
- the router never imports torch-heavy packages at module level through kv_transfer's format;
- per-role request state is typed: no `req.extra[...]` string keys anywhere.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(package: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for path in (ROOT / package).rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
        out[str(path.relative_to(ROOT))] = names
    return out


@pytest.mark.parametrize(("package", "forbidden"), [
    ("common/scheduler", "common.server"),
    ("kv_transfer", "common.server"),
    ("kv_transfer", "common.scheduler"),
])
def test_lower_layers_do_not_import_upper_ones(package: str, forbidden: str) -> None:
    bad = {f: sorted(m for m in mods if m == forbidden or m.startswith(forbidden + "."))
           for f, mods in imported_modules(package).items()}
    assert not {f: m for f, m in bad.items() if m}, bad


def test_no_string_keyed_request_state() -> None:
    pattern = re.compile(r"\.extra\[|\.extra\.(get|pop|setdefault)\(")
    hits = [f"{p.relative_to(ROOT)}:{i}" for pkg in ("common", "decode_server", "prefill_server")
            for p in (ROOT / pkg).rglob("*.py") for i, line in enumerate(p.read_text().splitlines(), 1)
            if pattern.search(line)]
    assert not hits, hits


def test_the_router_side_imports_no_torch() -> None:
    code = ("import sys, router.openai_request, router.model_info, common.server.protocol; "
            "print('torch' in sys.modules, 'nixl' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"], out.stdout


def test_an_instance_frontend_imports_no_torch(tiny_llama_path: str) -> None:
    """The HTTP frontend of a prefill/decode instance tokenizes and relays: torch (and
    transformers' AutoConfig detour) load only in its engine process, ~3 s of CPU per start."""
    code = ("import sys, common.server.launch, common.server.http_server, common.server.tokenizer_manager, "
            "common.server.input_processor, prefill_server.__main__, prefill_server.engine, "
            "decode_server.__main__, decode_server.engine; "
            "from common.tokenizer_loading import load_tokenizer; "
            f"load_tokenizer({tiny_llama_path!r}).encode('hi'); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False"], out.stdout
