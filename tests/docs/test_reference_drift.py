"""The generated reference pages (docs/reference/cli.md, metrics.md) equal what tools/gen_docs.py
makes from the code now, and that check fails when a flag or a metric is added without
regenerating: shown by generating from the real parsers / sources with one addition injected."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import gen_docs  # noqa: E402  (tools/ is not a package)


@pytest.fixture(scope="module")
def pd_help() -> str:
    return gen_docs.pd_sh_help()


@pytest.fixture(scope="module")
def metrics_input() -> gen_docs.MetricsInput:
    return gen_docs.metrics_input()


def test_cli_page_matches_the_code(pd_help: str) -> None:
    diff = gen_docs.page_diff(gen_docs.CLI_PAGE, gen_docs.CLI_PAGE.read_text(), gen_docs.render_cli(pd_help=pd_help))
    assert not diff, f"docs/reference/cli.md is stale; run `.venv/bin/python tools/gen_docs.py`:\n{diff}"


def test_metrics_page_matches_the_code(metrics_input: gen_docs.MetricsInput) -> None:
    diff = gen_docs.page_diff(gen_docs.METRICS_PAGE, gen_docs.METRICS_PAGE.read_text(),
                              gen_docs.render_metrics(metrics_input))
    assert not diff, f"docs/reference/metrics.md is stale; run `.venv/bin/python tools/gen_docs.py`:\n{diff}"


def test_every_role_and_flag_is_on_the_page() -> None:
    """What the drift test compares is complete: each role's parser, every flag of it."""
    page = gen_docs.CLI_PAGE.read_text()
    sections = gen_docs.cli_sections()
    assert {s.command.split(",")[0] for s in sections} >= {"python -m router", "python -m prefill_server"}
    assert set(sections[1].parsers) == {"prefill", "decode", "colocated"}
    for section in sections:
        for parser in section.parsers.values():
            for action in parser._actions:
                for flag in action.option_strings:
                    if flag not in ("-h", "--help"):
                        assert f"`{flag}`" in page, flag
    assert "`--num-prefill N`" not in page and "--num-prefill N" in page  # pd.sh's help, verbatim


def test_adding_a_flag_without_regenerating_fails(pd_help: str) -> None:
    sections = gen_docs.cli_sections()
    sections[0].parsers["router"].add_argument("--brand-new-flag", type=int, default=7, help="a flag nobody documented")
    diff = gen_docs.page_diff(gen_docs.CLI_PAGE, gen_docs.CLI_PAGE.read_text(),
                              gen_docs.render_cli(sections, pd_help=pd_help))
    assert "+| `--brand-new-flag` | `7` | int | a flag nobody documented |" in diff
    # and for the instances, whose flags come from ServerArgs through parse_server_args
    sections = gen_docs.cli_sections()
    for parser in sections[1].parsers.values():
        parser.add_argument("--another-new-flag", action="store_true", help="x")
    diff = gen_docs.page_diff(gen_docs.CLI_PAGE, gen_docs.CLI_PAGE.read_text(),
                              gen_docs.render_cli(sections, pd_help=pd_help))
    assert "+| `--another-new-flag` | off |  | x |" in diff


def test_adding_a_metric_without_regenerating_fails(metrics_input: gen_docs.MetricsInput) -> None:
    committed = gen_docs.METRICS_PAGE.read_text()
    extra = gen_docs.families_from_source(
        "from prometheus_client import Counter\n"
        "c = Counter('router_brand_new', 'a metric nobody documented', ['route'], registry=r)\n",
        "router/metrics.py")
    assert extra == [gen_docs.Family("router_brand_new_total", "counter", ("route",), "a metric nobody documented",
                                     "router/metrics.py")]
    data = metrics_input._replace(router=[*metrics_input.router, *extra])
    diff = gen_docs.page_diff(gen_docs.METRICS_PAGE, committed, gen_docs.render_metrics(data))
    assert "+| `router_brand_new_total` | counter | `route` |" in diff


def test_adding_an_engine_stats_key_without_regenerating_fails(metrics_input: gen_docs.MetricsInput) -> None:
    """An engine stats key is a gauge on every instance's /metrics: a new key in a stats() dict shows."""
    source = (REPO / "common/scheduler/scheduler.py").read_text()
    marker = '"num_waiting_reqs": float(len(self.waiting)),'
    assert marker in source
    keys = gen_docs.stats_keys_from_source(source.replace(marker, marker + ' "num_brand_new": 1.0,'),
                                           "Scheduler.stats")
    assert "num_brand_new" in keys and "num_waiting_reqs" in keys
    engine = [*metrics_input.engine, gen_docs.EngineStat("num_brand_new", "all", "test")]
    diff = gen_docs.page_diff(gen_docs.METRICS_PAGE, gen_docs.METRICS_PAGE.read_text(),
                              gen_docs.render_metrics(metrics_input._replace(engine=engine)))
    assert "+| `pdserve_num_brand_new` | all | test |" in diff


def test_check_mode_reports_a_stale_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """`tools/gen_docs.py --check` (what a pre-commit hook would run) exits 1 on a stale page."""
    stale = tmp_path / "metrics.md"
    stale.write_text(gen_docs.METRICS_PAGE.read_text().replace("router_requests_total", "router_requests_old"))
    monkeypatch.setattr(gen_docs, "generated_pages",
                        lambda: {stale: gen_docs.render_metrics()})
    assert gen_docs.main(["--check"]) == 1
    assert "+| `router_requests_total`" in capsys.readouterr().out
