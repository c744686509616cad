"""The one process harness of the test suite: every test that starts a process goes through here.

    ChildProcess(argv, name)     argv in its own process group, output appended to a log file;
                                 start() again after a kill (same log, a header per start)
    .wait_for(pred, ...)         bounded wait for a predicate; fails at once if the process
                                 exits, and every failure carries the log's tail
    .wait_http(url, ...)         the same for an HTTP path answering (a given status)
    .stop()                      SIGTERM to the PID, then SIGKILL to its whole group
    stop_all(children)           the same for several at once, their shutdowns overlapped
    reap_all()                   SIGKILL to every group still alive (end of the session)
    free_port()                  a port no other test process on this machine holds
    wait_until(cond, timeout_s)  the single polling helper (bool; callers assert with context)
    start_kind(argv)             what a start is (router, prefill_server, stub-decode, ...): every
                                 start is counted per kind and, with PDSERVE_TEST_START_LOG=FILE,
                                 appended to FILE as `kind<TAB>test id` (how many clusters a file starts)

The wrappers (tests/server/server_procs.py ServerProcess, tests/pd/pd_procs.py RoleProcess,
tests/reliability/procs.py Instance, tests/router/router_procs.py Proc, ...) compose a
ChildProcess and add what their role needs.
"""

from __future__ import annotations

import fcntl
import os
import random
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]
LOG_TAIL = 4000
# What a shared, loaded 2-core box may add to a timer-driven event: a wall-clock bound in a test
# is a configured timeout (or interval) plus this, never a bare number.
LOAD_SLACK_S = 2.0

# Below the kernel's ephemeral range (32768-60999 here): a port picked there could be taken by
# some outbound connection between this check and the server's bind, or its re-bind after a
# restart on the same port (seen in the reliability suite).
_PORT_RANGE = (20000, 32000)
_PORT_LOCKS = Path(tempfile.gettempdir()) / "pdserve-test-ports"
_held: dict[int, IO[bytes]] = {}  # port -> its lock file, open (locked) while this process lives


def _claim(port: int) -> bool:
    """Take the machine-wide lock for `port` (an flock on a file, released when this process
    exits): parallel test processes never hand out the same port."""
    _PORT_LOCKS.mkdir(exist_ok=True)
    f = (_PORT_LOCKS / str(port)).open("ab")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return False
    _held[port] = f
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, outside the ephemeral range, and held for this
    test process until it exits: never handed out twice, here or in a parallel test process
    (a server may be told its port before it binds it, or re-bind it after a restart)."""
    low, high = _PORT_RANGE
    start = random.randrange(high - low)
    for i in range(high - low):
        port = low + (start + i) % (high - low)
        if port in _held or not _claim(port):
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use by something else: keep the claim, never try it again
        return port
    raise RuntimeError("no free port found")


def wait_until(cond: Callable[[], bool], timeout_s: float, period_s: float = 0.05) -> bool:
    """Poll `cond` until it holds or `timeout_s` passed; the last check is made at the deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(period_s)
    return cond()


def stop_all(children: list[ChildProcess], timeout_s: float = 15.0) -> None:
    """close() several children, their shutdowns overlapped: SIGTERM to every leader first,
    then one shared wait, then SIGKILL to every group (an instance takes seconds to stop)."""
    live = [c for c in children if c.alive and c.popen is not None]
    for c in live:
        c.signal_group(signal.SIGCONT)
        assert c.popen is not None
        c.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for c in live:
        assert c.popen is not None
        try:
            c.popen.wait(max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            pass
    for c in children:
        c.close()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def http_ok(url: str, status: int | None = 200, timeout_s: float = 5.0) -> bool:
    """`url` answers (with `status`, unless None: any answer)."""
    try:
        code = httpx.get(url, timeout=timeout_s).status_code
    except httpx.HTTPError:
        return False
    return status is None or code == status


_started: list[ChildProcess] = []
# In every child's environment: leftovers are told from a process that reused a PID by it.
_OWNER = f"PDSERVE_TEST_OWNER={os.getpid()}-{random.getrandbits(64):x}"


def _leftovers(pgid: int) -> list[int]:
    """Processes of group `pgid` that a ChildProcess of this test process started."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            if _OWNER.encode() in (entry / "environ").read_bytes().split(b"\0"):
                out.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return out


def start_kind(argv: list[str]) -> str:
    """`python -m MODULE` -> MODULE; a stub worker -> stub-ROLE; anything else -> its program's name."""
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1]
    if "--role" in argv[:-1] and "stub_worker" in " ".join(argv):
        return "stub-" + argv[argv.index("--role") + 1]
    code = argv[argv.index("-c") + 1] if "-c" in argv[:-1] else ""
    for known in ("fake_engine", "stub_worker", "engine_process"):
        if known in code:
            return known
    return Path(argv[0]).name if not code else "python -c"


START_COUNTS: dict[str, int] = {}


def _record_start(argv: list[str]) -> None:
    kind = start_kind(argv)
    START_COUNTS[kind] = START_COUNTS.get(kind, 0) + 1
    if log := os.environ.get("PDSERVE_TEST_START_LOG"):
        test = os.environ.get("PYTEST_CURRENT_TEST", "-").rsplit(" ", 1)[0]
        with open(log, "a") as f:
            f.write(f"{kind}\t{test}\n")


def reap_all() -> None:
    """SIGKILL whatever a ChildProcess started and is still running (the session's last
    resort, called from tests/conftest.py)."""
    for child in _started:
        child.reap()
    _started.clear()


class ChildProcess:
    """One child process group started by a test; always stop() it (fixtures: in a finally).

    env is added to os.environ, with PYTHONPATH set to `pythonpath` (None: as inherited). The log is a temp
    file removed by close() unless PDSERVE_TEST_KEEP_LOGS is set, or `log_path` (kept)."""

    def __init__(self, argv: list[str], name: str, *, env: dict[str, str] | None = None, cwd: Path = REPO_ROOT,
                 preexec_fn: Callable[[], Any] | None = None, start: bool = True, log_path: Path | None = None,
                 pythonpath: str | None = str(REPO_ROOT)) -> None:
        self.argv = argv
        self.name = name
        owner, _, tag = _OWNER.partition("=")
        self.env = {**os.environ, **({"PYTHONPATH": pythonpath} if pythonpath is not None else {}), **(env or {}),
                    owner: tag}
        self.cwd = cwd
        self.preexec_fn = preexec_fn
        self.keep_log = log_path is not None or bool(os.environ.get("PDSERVE_TEST_KEEP_LOGS"))
        self.log_file: IO[bytes] = (log_path.open("ab") if log_path is not None else
                                    tempfile.NamedTemporaryFile(prefix=f"pdserve_{name}_", suffix=".log", delete=False))
        self.popen: subprocess.Popen[bytes] | None = None
        self.starts = 0
        if start:
            self.start()

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start (again): the previous run must be gone. Does not wait (see wait_for / wait_http)."""
        assert not self.alive, f"{self.name} is still running"
        if self.starts:
            self.log_file.write(f"\n==== start #{self.starts} ====\n".encode())
            self.log_file.flush()
        self.starts += 1
        _record_start(self.argv)
        self.popen = subprocess.Popen(self.argv, cwd=self.cwd, env=self.env, stdout=self.log_file,
                                      stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=self.preexec_fn)
        _started.append(self)

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal_group(self, sig: signal.Signals) -> None:
        """`sig` to every process of the group (a no-op once the group is gone)."""
        if self.popen is not None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass

    def kill9(self, timeout_s: float = 10.0) -> None:
        """SIGKILL the whole group and reap the leader."""
        if self.popen is not None:
            self.signal_group(signal.SIGKILL)
            self.popen.wait(timeout_s)

    def stop(self, timeout_s: float = 15.0, *, leftovers: bool = True) -> int | None:
        """SIGTERM to the leader (a stopped group is continued first), SIGKILL to the whole
        group after timeout_s; returns the leader's exit status (a negative signal number
        when it had to be killed). leftovers=False: what the leader left running is not
        killed now (a test checks that it exits by itself; reap_all() gets it at the end)."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.signal_group(signal.SIGCONT)
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill9()
        if leftovers:
            self.kill9()
        return self.popen.returncode

    def reap(self) -> None:
        """SIGKILL whatever this child started and is still running, also after its leader
        was reaped (then its group id may be reused: only processes carrying this test
        process's mark in their environment are killed)."""
        if self.popen is None:
            return
        if self.popen.poll() is None:
            self.kill9()
            return
        for pid in _leftovers(self.popen.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        """stop() and remove the log."""
        self.stop()
        self.log_file.close()
        if not self.keep_log:
            Path(self.log_file.name).unlink(missing_ok=True)

    # ---- waiting --------------------------------------------------------------------------------
    def log(self, tail: int | None = LOG_TAIL) -> str:
        """The log's last `tail` characters (None: all of it)."""
        if not self.log_file.closed:
            self.log_file.flush()
        try:
            text = Path(self.log_file.name).read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return text if tail is None else text[-tail:]

    def wait_for(self, pred: Callable[[], bool], timeout_s: float, what: str, period_s: float = 0.1) -> None:
        """Until `pred` holds; RuntimeError if the process exits first, TimeoutError past
        timeout_s (both with the log's tail)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.popen is not None and self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode} before {what}:\n{self.log()}")
            if pred():
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self.name}: no {what} within {timeout_s}s:\n{self.log()}")
            time.sleep(period_s)

    def wait_http(self, url: str, timeout_s: float, status: int | None = 200, period_s: float = 0.1) -> None:
        """Until GET `url` answers with `status` (None: any answer)."""
        self.wait_for(lambda: http_ok(url, status, timeout_s=2.0), timeout_s, f"answer from {url}", period_s)
