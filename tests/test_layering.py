"""Package layering, checked on the source: what may import what, and no untyped role state.

- common/scheduler and kv_transfer never import common/server (the server layer sits above);
- kv_transfer never imports common/scheduler (a transfer backend knows pages, not requests);
- the router and an instance's HTTP frontend import neither torch nor transformers (checked in a
  fresh interpreter that also loads the tokenizer and renders a chat template): they only tokenize;
- per-role request state is typed: no `req.extra[...]` string keys anywhere;
- benchmark scripts run as `python bench/X.py`: they never import the `bench` package.
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


def test_bench_scripts_do_not_import_the_bench_package() -> None:
    """`python bench/X.py` (every benchmark's documented command) puts bench/ on sys.path, not the
    repo root: a script importing `bench.something` stops with ModuleNotFoundError before it
    starts (bench/radix_memory.py and prefill_memory.py did). Siblings are imported by module name."""
    scripts = imported_modules("bench")
    bad = {f: sorted(m for m in mods if m == "bench" or m.startswith("bench."))
           for f, mods in scripts.items() if not Path(f).name.startswith("test_")}
    assert len(scripts) > 10 and not {f: m for f, m in bad.items() if m}, bad


def test_no_string_keyed_request_state() -> None:
    pattern = re.compile(r"\.extra\[|\.extra\.(get|pop|setdefault)\(")
    hits = [f"{p.relative_to(ROOT)}:{i}" for pkg in ("common", "decode_server", "prefill_server")
            for p in (ROOT / pkg).rglob("*.py") for i, line in enumerate(p.read_text().splitlines(), 1)
            if pattern.search(line)]
    assert not hits, hits


HEAVY = ("torch", "transformers", "nixl")


def _heavy_imports(code: str) -> list[str]:
    """What of HEAVY a fresh interpreter has imported after running `code`."""
    probe = f"{code}; import sys; print(*[m for m in {HEAVY!r} if m in sys.modules], 'end')"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()[:-1]


def test_the_router_imports_no_torch_nor_transformers(tiny_llama_path: str) -> None:
    """`python -m router` up to serving: its modules, the model info (tokenizer, chat template) and a request's ids."""
    code = ("import router.__main__, router.app, router.openai_request, common.server.protocol; "
            "from router.model_info import ModelInfo; "
            f"m = ModelInfo.load({tiny_llama_path!r}); m.encode('hi'); "
            "m.apply_chat_template([{'role': 'system', 'content': 's'}, {'role': 'user', 'content': 'hi'}])")
    assert _heavy_imports(code) == []


def test_an_instance_frontend_imports_no_torch_nor_transformers(tiny_llama_path: str) -> None:
    """The HTTP frontend of a prefill/decode instance tokenizes and relays: torch and transformers
    load only in its engine process (~2.5 s and ~1 s of CPU per start on a 2-core box)."""
    code = ("import common.server.launch, common.server.http_server, common.server.tokenizer_manager, "
            "common.server.input_processor, prefill_server.__main__, prefill_server.engine, "
            "decode_server.__main__, decode_server.engine; "
            "from common.server.launch import load_tokenizer; from common.server.server_args import ServerArgs; "
            f"t = load_tokenizer(ServerArgs(model_path={tiny_llama_path!r}).resolved()); "
            "t.decode(t.encode('hi')); t.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False)")
    assert _heavy_imports(code) == []


@pytest.mark.parametrize("module", ["router", "prefill_server", "decode_server", "common.server"])
def test_role_help_imports_no_torch_nor_transformers(module: str) -> None:
    """`python -X importtime -m ROLE --help`, as an operator would profile it."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", module, "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--model-path" in out.stdout
    imported = {line.rsplit("|", 1)[1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert len(imported) > 50, out.stderr[-2000:]  # the profile was read
    assert not {m for m in imported if m.split(".")[0] in HEAVY}, sorted(m for m in imported if m.split(".")[0] in HEAVY)
