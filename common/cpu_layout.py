"""Which CPUs each engine on a host gets: pure functions over CPU lists, and a CLI for launch/pd.sh.

Two engines whose OpenMP pools are each as wide as the machine spin against each other: on a
2-core box pd.sh's default 1P1D served 14x less under load than with one thread each (issue 49).
So every engine on a host gets a disjoint share of the CPUs the host lets us use (affinity, and
as many intra-op threads as CPUs), and whatever no engine got (`spare`) is where the router and
the instances' frontends run; when nothing is spare they share every CPU.

    parse_cpu_list("0-3,8")           -> (0, 1, 2, 3, 8)
    format_cpu_list((0, 1, 2, 3, 8))  -> "0-3,8"
    plan_host(allowed, ["prefill-0", "decode-0"])  -> HostLayout (even split, warnings)

Splitting rule: explicit lists (overrides) are taken as given; the other engines split what is
left evenly, lowest CPUs first, in the order named. One CPU is held back for the router and the
frontends when every engine still gets >= RESERVE_MIN_SHARE CPUs without it; the remainder of
an uneven split is spare too. Any CPU given to two engines, or a list naming a CPU the host does
not allow, is a warning (the layout is still used: the user asked for it).

Owned by the launchers: launch/pd.sh calls `python -m common.cpu_layout plan` once per host;
an instance resolves its own `--cpu-omp-threads-bind` through `engine_cpus` (common/cpu_runtime.py).
Importing this module must stay cheap (no torch): pd.sh runs it before anything starts.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

RESERVE_MIN_SHARE = 4  # hold one CPU back for router/frontends only when each engine keeps this many
AUTO = "auto"


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """ "0-3,8" -> (0, 1, 2, 3, 8): sorted, unique. The kernel's cpulist syntax (also taskset -c's)
    without strides. Raises ValueError on anything else, or on an empty list."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad CPU list {text!r}: expected e.g. 0-3,8")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"bad CPU list {text!r}: range {part} runs backwards")
        cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))


def format_cpu_list(cpus: Iterable[int]) -> str:
    """(0, 1, 2, 3, 8) -> "0-3,8"; an empty list -> ""."""
    ordered = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def allowed_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on (cgroup cpuset, taskset), sorted."""
    return tuple(sorted(os.sched_getaffinity(0)))


@dataclass(frozen=True)
class InstanceCpus:
    """One engine's share: its CPUs, and as many intra-op threads."""

    name: str
    cpus: tuple[int, ...]

    @property
    def threads(self) -> int:
        return len(self.cpus)

    def describe(self) -> str:
        return f"{self.name} cpus {format_cpu_list(self.cpus)} ({self.threads} thread{'s' * (self.threads != 1)})"


@dataclass(frozen=True)
class HostLayout:
    """The engines of one host, the CPUs none of them got, and what is wrong with the layout."""

    allowed: tuple[int, ...]
    instances: tuple[InstanceCpus, ...]
    spare: tuple[int, ...]  # router + frontends run here; () = they share every allowed CPU
    warnings: tuple[str, ...] = ()

    @property
    def others_cpus(self) -> tuple[int, ...]:
        """Where the router and the frontends run: the spare CPUs, else all allowed ones."""
        return self.spare or self.allowed

    def describe(self) -> str:
        """'prefill-0 cpus 0 (1 thread), decode-0 cpus 1 (1 thread), router/frontends: 0-1 shared'"""
        where = format_cpu_list(self.others_cpus) + ("" if self.spare else " shared")
        return ", ".join([*(i.describe() for i in self.instances), f"router/frontends: {where}"])

    def instance(self, name: str) -> InstanceCpus:
        for inst in self.instances:
            if inst.name == name:
                return inst
        raise KeyError(name)


def plan_host(
    allowed: Sequence[int],
    names: Sequence[str],
    *,
    cpus_per_instance: int | None = None,
    overrides: Mapping[str, Sequence[int]] | None = None,
) -> HostLayout:
    """Split `allowed` among the engines `names` (see the module docstring for the rule).

    cpus_per_instance: each engine without an override gets this many consecutive CPUs (past the
    end it wraps around: oversubscribed, and warned). overrides: name -> its explicit CPUs."""
    allowed_t = tuple(sorted(set(allowed)))
    if not allowed_t:
        raise ValueError("no allowed CPUs")
    if cpus_per_instance is not None and cpus_per_instance < 1:
        raise ValueError(f"cpus_per_instance must be >= 1, got {cpus_per_instance}")
    overrides = dict(overrides or {})
    unknown = set(overrides) - set(names)
    if unknown:
        raise ValueError(f"overrides for instances not on this host: {', '.join(sorted(unknown))}")
    warnings: list[str] = []
    given: dict[str, tuple[int, ...]] = {}
    for name, cpus in overrides.items():
        given[name] = tuple(sorted(set(cpus)))
        outside = set(given[name]) - set(allowed_t)
        if outside:
            warnings.append(f"{name}: CPUs {format_cpu_list(outside)} are not allowed here "
                            f"(allowed: {format_cpu_list(allowed_t)})")
    rest = [n for n in names if n not in given]
    taken = {c for cpus in given.values() for c in cpus}
    free = [c for c in allowed_t if c not in taken]
    if rest:
        if not free:
            warnings.append(f"no CPU left for {', '.join(rest)} after the explicit lists: they share all of "
                            f"{format_cpu_list(allowed_t)}")
            free = list(allowed_t)
        shares = _split(free, len(rest), cpus_per_instance, warnings)
        given.update(zip(rest, shares, strict=True))
    instances = tuple(InstanceCpus(n, given[n]) for n in names)
    warnings.extend(overlap_warnings(instances))
    used = {c for inst in instances for c in inst.cpus}
    spare = tuple(c for c in allowed_t if c not in used)
    return HostLayout(allowed_t, instances, spare, tuple(warnings))


def _split(free: list[int], n: int, per: int | None, warnings: list[str]) -> list[tuple[int, ...]]:
    if per is None:
        reserve = 1 if (len(free) - 1) // n >= RESERVE_MIN_SHARE else 0
        per = (len(free) - reserve) // n
        if per == 0:
            warnings.append(f"{n} engines on {len(free)} CPUs: some share a CPU (oversubscribed)")
            per = 1
    elif per * n > len(free):
        warnings.append(f"{n} engines x {per} CPUs > the {len(free)} CPUs available "
                        f"({format_cpu_list(free)}): oversubscribed")
    return [tuple(sorted({free[(k * per + j) % len(free)] for j in range(min(per, len(free)))})) for k in range(n)]


def overlap_warnings(instances: Sequence[InstanceCpus]) -> list[str]:
    """One line per pair of engines that share CPUs."""
    out = []
    for i, a in enumerate(instances):
        for b in instances[i + 1 :]:
            common = set(a.cpus) & set(b.cpus)
            if common:
                out.append(f"{a.name} and {b.name} share CPUs {format_cpu_list(common)}: oversubscribed, "
                           "their thread pools will contend")
    return out


def engine_cpus(spec: str, allowed: Sequence[int]) -> HostLayout:
    """One instance's `--cpu-omp-threads-bind`: "auto" = the allowed CPUs (one held back for the
    frontend on hosts large enough, see plan_host), else an explicit list. instance name: "engine"."""
    if spec == AUTO:
        return plan_host(allowed, ["engine"])
    return plan_host(allowed, ["engine"], overrides={"engine": parse_cpu_list(spec)})


# ---- CLI for launch/pd.sh ------------------------------------------------------------------
def _plan_main(ns: argparse.Namespace) -> int:
    allowed = parse_cpu_list(ns.allowed) if ns.allowed else allowed_cpus()
    names = [n for n in ns.names.split(",") if n]
    overrides = {}
    for item in ns.override:
        name, _, cpus = item.partition("=")
        overrides[name] = parse_cpu_list(cpus)
    layout = plan_host(allowed, names, cpus_per_instance=ns.cpus_per_instance, overrides=overrides)
    for inst in layout.instances:
        print(f"cpus {inst.name} {format_cpu_list(inst.cpus)}")
    print(f"others {format_cpu_list(layout.others_cpus)} {'spare' if layout.spare else 'shared'}")
    for w in layout.warnings:
        print(f"warning {w}")
    print(f"describe {layout.describe()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m common.cpu_layout", description="plan the CPUs of a host's engines")
    sub = ap.add_subparsers(dest="cmd", required=True)
    plan = sub.add_parser("plan", help="one line per engine ('cpus NAME LIST'), 'others LIST spare|shared', "
                          "'warning TEXT'..., 'describe TEXT'")
    plan.add_argument("--names", required=True, help="comma-separated engine names, in start order")
    plan.add_argument("--cpus-per-instance", type=int, default=None)
    plan.add_argument("--override", action="append", default=[], metavar="NAME=LIST")
    plan.add_argument("--allowed", default=None, help="CPU list to split (default: this process's affinity)")
    ns = ap.parse_args(argv)
    try:
        return _plan_main(ns)
    except ValueError as e:
        print(f"cpu_layout: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
