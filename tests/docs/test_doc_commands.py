"""Every command in README.md and docs/getting-started.md runs as written, on the default model.

The convention (docs/development.md, "Documentation tests"):

- fenced ```bash blocks are run with bash, ```python blocks with the venv's python, from the
  repository root; ```text / ```console blocks (and any other language) are shown, not run;
- a bash block that runs `launch/pd.sh` (other than `--help` / `--dry-run`) is a server start: it
  is started once for the whole module (one pd.sh for every block that needs it), waited for with
  a bound (its READY line), the other blocks run against it in document order, then it is
  stopped with SIGTERM as the docs say (Ctrl-C) and must leave no role running;
- NOT_RUN lists the blocks that are shown but never run here, each with its reason.

What the test changes in a command, and why: the suite runs beside deployments and parallel test
processes, so pd.sh gets ports held for this test (`--port`, `--prefill-port`, `--decode-port`,
`--bootstrap-port`) and a log directory under the test's tmp path, and `127.0.0.1:30000` in the
other blocks is rewritten to that router port. Nothing else is touched.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from typing import NamedTuple

import pytest

from tests.harness.process import free_port
from tests.launch.pd_launch import REPO_ROOT, PdLaunch

pytestmark = pytest.mark.slow

DOC_FILES = ("README.md", "docs/getting-started.md")
RUN_LANGS = ("bash", "python")
DEFAULT_URL = "127.0.0.1:30000"
COMMAND_TIMEOUT_S = 180.0  # one block: a few requests on the default model on a loaded 2-core box

# Shown to users, never run by this test. Each would recurse into or redo what runs this test.
NOT_RUN = {
    "bash launch/install.sh": "installs the venv this test runs in (launch/test.sh runs it before the suite)",
    "bash launch/test.sh": "runs the whole suite, this test included (CI's command, .ci/run)",
}

_FENCE = re.compile(r"^```([A-Za-z0-9_+-]*)[^\n]*\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)


class Block(NamedTuple):
    doc: str
    line: int
    lang: str
    text: str

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def doc_blocks(doc: str) -> list[Block]:
    text = (REPO_ROOT / doc).read_text()
    return [Block(doc, text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2)) for m in _FENCE.finditer(text)]


def is_server_start(block: Block) -> bool:
    if block.lang != "bash":
        return False
    argv = shlex.split(block.text, comments=True)
    return "launch/pd.sh" in argv and not {"--help", "-h", "--dry-run"} & set(argv)


def not_run_reason(block: Block) -> str | None:
    return NOT_RUN.get(block.text.strip()) if block.lang == "bash" else None


ALL_BLOCKS = [b for doc in DOC_FILES for b in doc_blocks(doc)]
RUN_BLOCKS = [b for b in ALL_BLOCKS if b.lang in RUN_LANGS and not_run_reason(b) is None]
SERVER_BLOCKS = [b for b in RUN_BLOCKS if is_server_start(b)]
CLIENT_BLOCKS = [b for b in RUN_BLOCKS if not is_server_start(b)]


class Served(NamedTuple):
    command: str  # the block's text, as written
    port: int


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The docs' one server command, started as written plus test-held ports; stopped at the end."""
    commands = {b.text.strip() for b in SERVER_BLOCKS}
    assert len(commands) == 1, f"the docs start pd.sh in more than one way; give each its own start: {commands}"
    command = commands.pop()
    argv = shlex.split(command, comments=True)
    assert argv[:2] == ["bash", "launch/pd.sh"], f"a server block must be `bash launch/pd.sh [FLAGS]`: {command!r}"
    ports = {flag: free_port() for flag in ("--port", "--prefill-port", "--decode-port", "--bootstrap-port")}
    extra = [x for flag, port in ports.items() for x in (flag, str(port))]
    run = PdLaunch(argv[2:] + extra, tmp_path_factory.mktemp("doc_pd") / "logs")
    try:
        run.wait_ready()
        yield Served(command, ports["--port"])
        assert run.stop() == 143, run.output()[-3000:]  # pd.sh exits 128 + SIGTERM after stopping every role
        assert run.live_groups() == [], "a role survived pd.sh's SIGTERM"
    finally:
        run.kill_leftovers()


def _with_port(text: str, port: int) -> str:
    return text.replace(DEFAULT_URL, f"127.0.0.1:{port}")


def test_the_docs_show_the_set_up_commands() -> None:
    """The README shows both set-up commands and the server start; CI runs exactly the test command."""
    readme = [b.text.strip() for b in doc_blocks("README.md") if b.lang == "bash"]
    assert "bash launch/install.sh" in readme and "bash launch/test.sh" in readme
    assert any(is_server_start(b) for b in doc_blocks("README.md"))
    ci = (REPO_ROOT / ".ci" / "run").read_text().splitlines()
    assert "bash launch/test.sh" in ci  # the README's test command is CI's
    # every block left out is one of NOT_RUN, and each NOT_RUN command is really in the docs
    skipped = {b.text.strip() for b in ALL_BLOCKS if not_run_reason(b) is not None}
    assert skipped == set(NOT_RUN)
    assert len(CLIENT_BLOCKS) >= 5 and SERVER_BLOCKS


@pytest.mark.parametrize("block", SERVER_BLOCKS, ids=lambda b: b.id)
def test_server_command_serves(block: Block, served: Served) -> None:
    import httpx

    assert block.text.strip() == served.command
    r = httpx.get(f"http://127.0.0.1:{served.port}/health", timeout=30)
    assert r.status_code == 200, r.text
    r = httpx.post(f"http://127.0.0.1:{served.port}/v1/completions", timeout=COMMAND_TIMEOUT_S,
                   json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text


@pytest.mark.parametrize("block", CLIENT_BLOCKS, ids=lambda b: b.id)
def test_command_runs_as_written(block: Block, served: Served) -> None:
    text = _with_port(block.text, served.port)
    if block.lang == "bash":
        argv = ["bash", "-e", "-o", "pipefail", "-c", text]
    else:
        argv = [sys.executable, "-c", text]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, env=env)
    assert out.returncode == 0, f"{block.id} exited {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
    assert out.stdout.strip(), f"{block.id} printed nothing"
    # a request the server refused still exits 0 with curl: its answer must not be an error body
    assert '"error"' not in out.stdout, f"{block.id} got an error:\n{out.stdout[-2000:]}"
