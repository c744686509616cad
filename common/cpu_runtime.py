"""The CPU runtime of an instance's engine process: its CPUs, its intra-op threads, its preloads.

Owned by the instance launcher (common/server/launch.py): `plan_engine(args)` turns
`--cpu-omp-threads-bind` and `--cpu-preload-libs` into an EnginePlacement, which EngineHandle
applies when it spawns the engine process (the CPUs as the spawning thread's affinity, inherited
through fork + exec; the variables in the spawned process's environment). So both are in force
before the engine's first instruction: libgomp reads OMP_NUM_THREADS when it is loaded, and every
thread the engine starts (the overlap loop's forward thread, whose OpenMP pool is the one that
matters: common/model/intra_op.py) inherits the affinity. The frontend keeps its own CPUs.

`active_runtime(pid)` says what the live engine process really runs with, read from /proc
(/server_info "cpu_runtime"), so a preload that did not take is visible.

Preloads (vLLM's CPU docs ask for both): tcmalloc (Debian's libtcmalloc-minimal4; jemalloc is
accepted too) and Intel's OpenMP (PyPI's intel-openmp puts libiomp5.so in <venv>/lib). Only
libraries that exist are preloaded; none found = today's glibc malloc + libgomp. On CUDA nothing
changes. By default ("auto") only Intel's OpenMP, by measurement (docs/cpu.md).
"""

from __future__ import annotations

import os
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.cpu_layout import HostLayout, allowed_cpus, engine_cpus, format_cpu_list, parse_cpu_list

if TYPE_CHECKING:
    from common.server.server_args import ServerArgs

# name -> file names tried, in order, in each library directory
PRELOAD_LIBS: dict[str, tuple[str, ...]] = {
    "tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"),
    "jemalloc": ("libjemalloc.so.2",),
    "iomp5": ("libiomp5.so",),
}
ALLOCATORS = ("tcmalloc", "jemalloc")
# What "auto" preloads when found. Measured (docs/cpu.md): Intel's OpenMP 1.09-1.23x on 8 cores,
# neutral on 2; tcmalloc as much, but it keeps freed memory from glibc's malloc_trim, which bounds
# the engine's RSS (common/server/heap_trim.py), so it is opt-in.
DEFAULT_PRELOAD = ("iomp5",)
PRELOAD_ENV = "PDSERVE_CPU_PRELOAD_LIBS"  # the default of --cpu-preload-libs when it is "auto"
LIB_PATH_ENV = "PDSERVE_CPU_LIB_PATH"  # extra directories searched first (colon-separated)


def parse_preload(spec: str) -> tuple[str, ...]:
    """ "auto" -> DEFAULT_PRELOAD ($PDSERVE_CPU_PRELOAD_LIBS when set), "none" -> (), else a
    comma list of PRELOAD_LIBS names (at most one allocator). Raises ValueError."""
    if spec == "auto":
        spec = os.environ.get(PRELOAD_ENV) or "auto"
        if spec == "auto":
            return DEFAULT_PRELOAD
    if spec == "none":
        return ()
    names = tuple(n.strip() for n in spec.split(",") if n.strip())
    bad = [n for n in names if n not in PRELOAD_LIBS]
    if bad or not names:
        raise ValueError(f"--cpu-preload-libs takes auto, none or a comma list of {', '.join(PRELOAD_LIBS)}; got {spec!r}")
    if sum(n in ALLOCATORS for n in names) > 1:
        raise ValueError(f"--cpu-preload-libs names two allocators: {spec!r}")
    return names


def validate_bind(spec: str | None) -> str | None:
    """The problem with a --cpu-omp-threads-bind value, or None."""
    if spec is None or spec == "auto":
        return None
    try:
        parse_cpu_list(spec)
    except ValueError as e:
        return f"--cpu-omp-threads-bind takes auto or a CPU list: {e}"
    return None


def lib_dirs() -> list[Path]:
    extra = [Path(p) for p in os.environ.get(LIB_PATH_ENV, "").split(":") if p]
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    dirs = [Path(sys.prefix) / "lib", Path("/usr/lib") / multiarch if multiarch else None,
            Path("/usr/lib64"), Path("/usr/local/lib"), Path("/usr/lib")]
    return extra + [d for d in dirs if d is not None]


def find_lib(name: str) -> str | None:
    """The path of preload library `name` (a PRELOAD_LIBS key), or None when it is not installed."""
    for d in lib_dirs():
        for fname in PRELOAD_LIBS[name]:
            path = d / fname
            if path.is_file():
                return str(path)
    return None


@dataclass(frozen=True)
class EnginePlacement:
    """How the engine process is started: its CPUs (None: not confined), the CPUs its frontend
    moves to (None: stays where it is), and variables for its environment."""

    cpus: tuple[int, ...] | None = None
    frontend_cpus: tuple[int, ...] | None = None
    env: dict[str, str] = field(default_factory=dict)
    layout: HostLayout | None = None

    def describe(self) -> str:
        parts = []
        if self.cpus is not None:
            parts.append(f"engine cpus {format_cpu_list(self.cpus)} ({len(self.cpus)} threads)")
        if self.frontend_cpus is not None:
            parts.append(f"frontend cpus {format_cpu_list(self.frontend_cpus)}")
        if "LD_PRELOAD" in self.env:
            parts.append(f"LD_PRELOAD={self.env['LD_PRELOAD']}")
        return ", ".join(parts) or "unchanged"


NO_PLACEMENT = EnginePlacement()


def runs_on_cpu(args: ServerArgs) -> bool:
    """Whether the engine will run on CPU, decided without importing torch (the frontend never
    does): --device cpu, or auto on a host where no NVIDIA device is visible."""
    if args.device != "auto":
        return args.device == "cpu"
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return True
    return not any(Path("/dev").glob("nvidia[0-9]*"))


def plan_engine(args: ServerArgs, allowed: tuple[int, ...] | None = None) -> EnginePlacement:
    """The placement of this instance's engine; NO_PLACEMENT on CUDA."""
    if not runs_on_cpu(args):
        return NO_PLACEMENT
    env: dict[str, str] = {}
    cpus = frontend = None
    layout = None
    if args.cpu_omp_threads_bind is not None:
        layout = engine_cpus(args.cpu_omp_threads_bind, allowed or allowed_cpus())
        cpus = layout.instance("engine").cpus
        env["OMP_NUM_THREADS"] = str(len(cpus))
        if args.cpu_omp_threads_bind == "auto" and layout.spare:
            frontend = layout.spare  # an explicit list: the launcher placed the frontend (pd.sh)
    preload = [p for p in (find_lib(n) for n in parse_preload(args.cpu_preload_libs)) if p is not None]
    if preload:
        inherited = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p]
        names = {Path(p).name for p in inherited}
        env["LD_PRELOAD"] = ":".join([p for p in preload if Path(p).name not in names] + inherited)
    return EnginePlacement(cpus, frontend, env, layout)


def confine_this_process(cpus: tuple[int, ...]) -> None:
    """Every thread of this process (sched_setaffinity is per thread) on `cpus`."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):
            pass  # a thread that ended meanwhile


def active_runtime(pid: int) -> dict[str, Any]:
    """What process `pid` runs with now: allocator, OpenMP runtime, allowed CPUs, intra-op threads
    (its OMP_NUM_THREADS, else one per allowed CPU)."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    allocator = next((n for n in ALLOCATORS if f"lib{n}" in maps), "glibc")
    openmp = "iomp5" if "libiomp5" in maps else "gomp" if "libgomp" in maps else "none"
    cpus: tuple[int, ...] = ()
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            cpus = parse_cpu_list(line.split(":", 1)[1])
    threads = len(cpus)
    try:
        for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            if entry.startswith(b"OMP_NUM_THREADS=") and entry[16:].isdigit():
                threads = int(entry[16:])
    except OSError:
        pass
    return {"allocator": allocator, "openmp": openmp, "cpus": list(cpus), "threads": threads}
