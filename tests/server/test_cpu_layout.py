"""common/cpu_layout.py and the pure parts of common/cpu_runtime.py: CPU lists, the split of a
host's CPUs among its engines, overrides, oversubscription warnings, preload resolution."""

from __future__ import annotations

from pathlib import Path

import pytest

from common import cpu_runtime
from common.cpu_layout import engine_cpus, format_cpu_list, main, parse_cpu_list, plan_host
from common.server.server_args import ServerArgs


@pytest.mark.parametrize(("text", "cpus"), [
    ("0", (0,)), ("0-3,8", (0, 1, 2, 3, 8)), (" 8,0-1 ", (0, 1, 8)), ("2,2,1-2", (1, 2)), ("10-12", (10, 11, 12)),
])
def test_parse_cpu_list(text: str, cpus: tuple[int, ...]) -> None:
    assert parse_cpu_list(text) == cpus
    assert parse_cpu_list(format_cpu_list(cpus)) == cpus


@pytest.mark.parametrize("text", ["", "a", "1-", "-1", "3-1", "0,,1", "0-3:2", "1 2"])
def test_parse_cpu_list_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        parse_cpu_list(text)


def test_format_cpu_list_ranges() -> None:
    assert format_cpu_list([8, 0, 1, 2, 3, 5]) == "0-3,5,8"
    assert format_cpu_list([]) == ""


def test_two_engines_on_two_cores_get_one_each_and_others_share() -> None:
    layout = plan_host((0, 1), ["prefill-0", "decode-0"])
    assert [(i.name, i.cpus, i.threads) for i in layout.instances] == [("prefill-0", (0,), 1), ("decode-0", (1,), 1)]
    assert layout.spare == () and layout.others_cpus == (0, 1) and layout.warnings == ()
    assert layout.describe() == ("prefill-0 cpus 0 (1 thread), decode-0 cpus 1 (1 thread), "
                                 "router/frontends: 0-1 shared")


def test_even_split_leaves_remainder_and_one_reserved_cpu_spare() -> None:
    # 7 CPUs, 3 engines: 2 each, the 7th spare (each would keep < 4 with a reserved one)
    layout = plan_host(range(7), ["a", "b", "c"])
    assert [i.cpus for i in layout.instances] == [(0, 1), (2, 3), (4, 5)] and layout.spare == (6,)
    # 16 CPUs, 2 engines: one held back for router/frontends, 7 each, the remainder spare too
    layout = plan_host(range(16), ["p", "d"])
    assert [i.cpus for i in layout.instances] == [tuple(range(7)), tuple(range(7, 14))]
    assert layout.spare == (14, 15) and layout.describe().endswith("router/frontends: 14-15")
    # a host's allowed CPUs need not start at 0 nor be contiguous
    layout = plan_host((4, 5, 9, 10), ["p", "d"])
    assert [i.cpus for i in layout.instances] == [(4, 5), (9, 10)]


def test_cpus_per_instance() -> None:
    layout = plan_host(range(8), ["p", "d"], cpus_per_instance=3)
    assert [i.cpus for i in layout.instances] == [(0, 1, 2), (3, 4, 5)] and layout.spare == (6, 7)
    assert layout.warnings == ()


def test_cpus_per_instance_beyond_the_host_wraps_and_warns() -> None:
    layout = plan_host((0, 1), ["p", "d"], cpus_per_instance=2)
    assert [i.cpus for i in layout.instances] == [(0, 1), (0, 1)]
    assert any("2 engines x 2 CPUs > the 2 CPUs" in w for w in layout.warnings)
    assert any("p and d share CPUs 0-1" in w for w in layout.warnings)


def test_more_engines_than_cpus_warns() -> None:
    layout = plan_host((0, 1), ["a", "b", "c"])
    assert [i.cpus for i in layout.instances] == [(0,), (1,), (0,)]
    assert any("3 engines on 2 CPUs" in w for w in layout.warnings)
    assert any("a and c share CPUs 0" in w for w in layout.warnings)


def test_overrides_are_kept_and_the_rest_split_what_is_left() -> None:
    layout = plan_host(range(8), ["p", "d0", "d1"], overrides={"p": (0, 1, 2, 3)})
    assert [i.cpus for i in layout.instances] == [(0, 1, 2, 3), (4, 5), (6, 7)]
    assert layout.warnings == () and layout.spare == ()


def test_overlapping_overrides_warn() -> None:
    layout = plan_host(range(4), ["p", "d"], overrides={"p": (0, 1, 2), "d": (2, 3)})
    assert [i.cpus for i in layout.instances] == [(0, 1, 2), (2, 3)]
    assert layout.warnings == ("p and d share CPUs 2: oversubscribed, their thread pools will contend",)


def test_override_outside_the_allowed_cpus_warns() -> None:
    layout = plan_host((0, 1), ["p", "d"], overrides={"p": (5,)})
    assert any("p: CPUs 5 are not allowed here" in w for w in layout.warnings)
    assert layout.instance("d").cpus == (0, 1)


def test_overrides_taking_every_cpu_leave_the_rest_sharing_all() -> None:
    layout = plan_host((0, 1), ["p", "d"], overrides={"p": (0, 1)})
    assert layout.instance("d").cpus == (0, 1)
    assert any("no CPU left for d" in w for w in layout.warnings)


def test_bad_plans_are_refused() -> None:
    with pytest.raises(ValueError):
        plan_host((), ["p"])
    with pytest.raises(ValueError):
        plan_host((0,), ["p"], cpus_per_instance=0)
    with pytest.raises(ValueError):
        plan_host((0,), ["p"], overrides={"x": (0,)})


def test_engine_cpus_auto_and_list() -> None:
    assert engine_cpus("auto", (0, 1)).instance("engine").cpus == (0, 1)
    auto8 = engine_cpus("auto", range(8))
    assert auto8.instance("engine").cpus == tuple(range(7)) and auto8.spare == (7,)
    assert engine_cpus("1", (0, 1)).instance("engine").cpus == (1,)


def test_cli_plan_prints_what_pd_sh_reads(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--names", "prefill-0,decode-0", "--allowed", "0-3", "--override", "decode-0=3"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "cpus prefill-0 0-2",
        "cpus decode-0 3",
        "others 0-3 shared",
        "describe prefill-0 cpus 0-2 (3 threads), decode-0 cpus 3 (1 thread), router/frontends: 0-3 shared",
    ]
    assert main(["plan", "--names", "p", "--allowed", "0-x"]) == 2


# ---- cpu_runtime ---------------------------------------------------------------------------
def test_parse_preload(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cpu_runtime.PRELOAD_ENV, raising=False)
    assert cpu_runtime.parse_preload("auto") == cpu_runtime.DEFAULT_PRELOAD
    assert cpu_runtime.parse_preload("none") == ()
    assert cpu_runtime.parse_preload("jemalloc,iomp5") == ("jemalloc", "iomp5")
    monkeypatch.setenv(cpu_runtime.PRELOAD_ENV, "none")
    assert cpu_runtime.parse_preload("auto") == ()
    for bad in ("tcmalloc,jemalloc", "mimalloc", ","):
        with pytest.raises(ValueError):
            cpu_runtime.parse_preload(bad)
    with pytest.raises(ValueError, match="--cpu-preload-libs"):
        ServerArgs(cpu_preload_libs="mimalloc")
    with pytest.raises(ValueError, match="--cpu-omp-threads-bind"):
        ServerArgs(cpu_omp_threads_bind="0-")


def _fake_lib_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *names: str) -> Path:
    for name in names:
        (tmp_path / name).write_bytes(b"")
    monkeypatch.setenv(cpu_runtime.LIB_PATH_ENV, str(tmp_path))
    return tmp_path


def test_plan_engine_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    libs = _fake_lib_dir(tmp_path, monkeypatch, "libtcmalloc_minimal.so.4", "libiomp5.so")
    monkeypatch.setenv("LD_PRELOAD", "/opt/x/libfoo.so")
    placement = cpu_runtime.plan_engine(
        ServerArgs(device="cpu", cpu_omp_threads_bind="1", cpu_preload_libs="tcmalloc,iomp5"), allowed=(0, 1))
    assert placement.cpus == (1,) and placement.frontend_cpus is None  # a list: the launcher placed the frontend
    assert placement.env == {
        "OMP_NUM_THREADS": "1",
        "LD_PRELOAD": f"{libs}/libtcmalloc_minimal.so.4:{libs}/libiomp5.so:/opt/x/libfoo.so",
    }
    auto = cpu_runtime.plan_engine(ServerArgs(device="cpu", cpu_omp_threads_bind="auto", cpu_preload_libs="none"),
                                   allowed=tuple(range(6)))
    assert auto.cpus == (0, 1, 2, 3, 4) and auto.frontend_cpus == (5,) and auto.env == {"OMP_NUM_THREADS": "5"}


def test_plan_engine_missing_libs_and_cuda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_lib_dir(tmp_path, monkeypatch)
    monkeypatch.setattr(cpu_runtime, "lib_dirs", lambda: [tmp_path])
    unbound = cpu_runtime.plan_engine(ServerArgs(device="cpu"))
    assert unbound.cpus is None and unbound.env == {}  # nothing installed, nothing asked: unchanged
    cuda = ServerArgs(device="cuda", cpu_omp_threads_bind="0")
    assert cpu_runtime.plan_engine(cuda) == cpu_runtime.NO_PLACEMENT
