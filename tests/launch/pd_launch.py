"""Run launch/pd.sh from a test and make sure nothing it started survives the test.

`PdLaunch` starts pd.sh (its own process group, output in a file), waits for its READY
line or its exit, and `stop()` sends SIGTERM to pd.sh only, as an operator would. The
`pids` file pd.sh writes (`NAME HOST PID LOG` per role) tells the test which process
groups it started; `live_groups()` lists the ones that still have a running (non-zombie)
process. `kill_leftovers()` is the fixture's last resort: SIGKILL to those groups only.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.harness.process import REPO_ROOT, ChildProcess

__all__ = ["PD_SH", "READY_MARK", "REPO_ROOT", "RoleRecord", "PdLaunch", "group_alive", "group_procs"]

PD_SH = REPO_ROOT / "launch" / "pd.sh"
READY_MARK = "pd.sh: READY"
START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 90.0


@dataclass(frozen=True)
class RoleRecord:
    name: str
    host: str
    pid: int
    log: Path


def group_alive(pgid: int) -> bool:
    """True while any process of group `pgid` is running; zombies count as gone."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def group_procs(pgids: set[int]) -> dict[int, tuple[bytes, bytes]]:
    """Every live process of the groups `pgids`: pid -> (cmdline, environ), NUL-separated bytes."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) in pgids and fields[0] != "Z":
                out[int(entry.name)] = ((entry / "cmdline").read_bytes(), (entry / "environ").read_bytes())
        except OSError:
            continue
    return out


class PdLaunch:
    """One pd.sh run; always call stop() (fixtures: in a finally)."""

    def __init__(self, args: list[str], log_dir: Path, *, env: dict[str, str] | None = None) -> None:
        self.log_dir = log_dir
        self.out_path = log_dir.parent / f"{log_dir.name}.pd_sh.out"
        self.child = ChildProcess(["bash", str(PD_SH), "--log-dir", str(log_dir), "--stop-timeout", "15", *args],
                                  "pd_sh", env=env, log_path=self.out_path, pythonpath=None)

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        assert self.child.popen is not None
        return self.child.popen

    def output(self) -> str:
        return self.child.log(tail=None)

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        self.child.wait_for(lambda: READY_MARK in self.output(), timeout_s, "READY line", period_s=0.3)

    def wait_exit(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        return self.proc.wait(timeout_s)

    def roles(self) -> list[RoleRecord]:
        path = self.log_dir / "pids"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            name, host, pid, log = line.split(" ", 3)
            out.append(RoleRecord(name, host, int(pid), Path(log)))
        return out

    def live_groups(self) -> list[RoleRecord]:
        return [r for r in self.roles() if group_alive(r.pid)]

    def stop(self) -> int:
        """SIGTERM to pd.sh; returns its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.wait_exit()

    def kill_leftovers(self) -> None:
        if self.child.alive:
            self.child.kill9()
        for r in self.live_groups():
            try:
                os.killpg(r.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.child.close()
