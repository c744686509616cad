"""The systems bench/peer.py compares: how each is named, started, reached and stopped.

    NAME=launch:colocated        launch/pd.sh --colocated 1 (ours, no disaggregation)
    NAME=launch:pd               launch/pd.sh with its defaults (1 prefill + 1 decode + router)
    NAME=launch:<pd.sh flags>    launch/pd.sh with these flags, e.g. "launch:--colocated 1 --env K=V"
    NAME=cmd:<command line>      any OpenAI server, run by bash; `{model}` and `{port}` are replaced
                                 by the model dir and a free port (without `{port}`: the command's
                                 --port, default 8000, and --host, default 127.0.0.1)
    NAME=url:<base url>          a server that is already running (not started, not stopped)

Every launch gets the model dir, --dtype and free ports from peer.py; pd.sh itself is a black
box (its core layout, its runtime). A started system runs in its own process group(s) and is
stopped fully when the `running` context ends, also when its start failed: SIGTERM, a bounded
wait, SIGKILL to every group it started (for pd.sh: its own and each role's, from its pids
file). Every wait is bounded; a system that does not come up raises SystemStartError with the
reason and the tail of its log.
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.harness.process import ChildProcess, free_port, http_ok, wait_until  # noqa: E402
from tests.launch.pd_launch import PdLaunch  # noqa: E402

KINDS = ("launch", "cmd", "url")
LAUNCH_SHORTHANDS = {"colocated": ["--colocated", "1"], "pd": []}
NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]*")


class SystemStartError(RuntimeError):
    """A system did not come up (or could not be reached); the message says why."""


@dataclass(frozen=True)
class SystemSpec:
    name: str  # a key prefix in the RESULT line
    kind: str  # launch | cmd | url
    arg: str  # pd.sh flags or shorthand, command line, or base url

    @classmethod
    def parse(cls, text: str) -> SystemSpec:
        name, sep, rest = text.partition("=")
        kind, sep2, arg = rest.partition(":")
        if not sep or not sep2 or not NAME_RE.fullmatch(name) or kind not in KINDS or not arg.strip():
            raise ValueError(f"--system wants NAME=launch:ARGS|cmd:COMMAND|url:URL with NAME like {NAME_RE.pattern}, "
                             f"got {text!r}")
        return cls(name, kind, arg.strip())

    def launch_flags(self) -> list[str]:
        return list(LAUNCH_SHORTHANDS.get(self.arg, shlex.split(self.arg)))


@dataclass(frozen=True)
class StartConfig:
    model_path: str
    dtype: str
    launch_args: list[str]  # added to every pd.sh launch
    ready_timeout_s: float
    stop_timeout_s: float
    log_dir: Path


@dataclass(frozen=True)
class Running:
    url: str
    model: str  # the first id of GET /v1/models: what requests must name
    log: Path  # pd.sh's log dir, the command's log, or nothing (url)


@contextmanager
def running(spec: SystemSpec, cfg: StartConfig) -> Iterator[Running]:
    """Start `spec`, yield where it serves, stop it (whatever happened in between)."""
    log = cfg.log_dir / spec.name
    if spec.kind == "url":
        url = spec.arg.rstrip("/")
        if not wait_until(lambda: http_ok(url + "/v1/models"), cfg.ready_timeout_s, period_s=0.5):
            raise SystemStartError(f"{url}/v1/models did not answer 200 within {cfg.ready_timeout_s:.0f} s")
        yield Running(url, first_model(url), log)
    elif spec.kind == "cmd":
        with _command(spec, cfg, log) as r:
            yield r
    else:
        with _launch(spec, cfg, log) as r:
            yield r


def command_url(command: str) -> str:
    """Where a command line that was given its own --host/--port (vLLM's defaults otherwise) serves."""
    words = shlex.split(command)
    host, port = "127.0.0.1", "8000"
    for flag, value in zip(words, words[1:], strict=False):
        if flag == "--port":
            port = value
        elif flag == "--host" and value not in ("0.0.0.0", "::", ""):
            host = value
    return f"http://{host}:{port}"


@contextmanager
def _command(spec: SystemSpec, cfg: StartConfig, log: Path) -> Iterator[Running]:
    command = spec.arg.replace("{model}", shlex.quote(cfg.model_path))
    if "{port}" in spec.arg:
        port = free_port()
        command, url = command.replace("{port}", str(port)), f"http://127.0.0.1:{port}"
    else:
        url = command_url(command)
    if http_ok(url + "/v1/models", status=None, timeout_s=2.0):
        raise SystemStartError(f"something already serves {url}: stop it, or give this system as url:{url}")
    log.parent.mkdir(parents=True, exist_ok=True)
    child = ChildProcess(["bash", "-c", command], spec.name, log_path=log.with_suffix(".log"), pythonpath=None)
    try:
        try:
            child.wait_http(url + "/v1/models", cfg.ready_timeout_s, period_s=1.0)
        except (RuntimeError, TimeoutError) as e:
            raise SystemStartError(_short(str(e))) from None
        yield Running(url, first_model(url), log.with_suffix(".log"))
    finally:
        child.stop(cfg.stop_timeout_s)
        child.close()


@contextmanager
def _launch(spec: SystemSpec, cfg: StartConfig, log: Path) -> Iterator[Running]:
    port = free_port()
    args = ["--model-path", cfg.model_path, "--dtype", cfg.dtype, "--port", str(port),
            "--prefill-port", str(free_port()), "--decode-port", str(free_port()),
            "--bootstrap-port", str(free_port()), "--start-timeout", str(int(cfg.ready_timeout_s)),
            *spec.launch_flags(), *cfg.launch_args]
    log.parent.mkdir(parents=True, exist_ok=True)
    pd = PdLaunch(args, log)
    try:
        try:  # pd.sh bounds each role's start itself; the margin covers its own steps around them
            pd.wait_ready(cfg.ready_timeout_s + 60)
        except (RuntimeError, TimeoutError) as e:
            raise SystemStartError(_short(str(e))) from None
        url = f"http://127.0.0.1:{port}"
        yield Running(url, first_model(url), log)
    finally:
        try:
            pd.stop()
        except Exception as e:  # noqa: BLE001 - whatever happened, the leftovers still go
            print(f"peer: [{spec.name}] pd.sh did not stop cleanly ({e}); killing its groups", file=sys.stderr)
        pd.kill_leftovers()


def first_model(url: str) -> str:
    try:
        data = httpx.get(url + "/v1/models", timeout=10).raise_for_status().json()["data"]
        return str(data[0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise SystemStartError(f"{url}/v1/models named no model ({e})") from None


def _short(text: str, n: int = 1500) -> str:
    return text if len(text) <= n else "..." + text[-n:]
