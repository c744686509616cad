"""Engine stats become `pdserve_<key>` gauges without clashing with the frontend's own metrics."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from common.server.metrics import FrontendMetrics


def test_engine_stats_are_gauges_and_clashes_are_renamed() -> None:
    metrics = FrontendMetrics()
    metrics.prompt_tokens.inc(5)
    metrics.engine.up = True
    metrics.engine.stats = {"num_running_reqs": 3.0, "kv-usage": 0.25, "prompt_tokens_total": 9.0}
    families = list(text_string_to_metric_families(metrics.render().decode()))
    names = [f.name for f in families]
    assert len(names) == len(set(names))
    samples = {s.name: s.value for f in families for s in f.samples}
    assert samples["pdserve_num_running_reqs"] == 3.0
    assert samples["pdserve_kv_usage"] == 0.25
    assert samples["pdserve_prompt_tokens_total"] == 5.0  # the frontend's counter keeps its name
    assert samples["pdserve_engine_prompt_tokens_total"] == 9.0
    assert samples["pdserve_engine_up"] == 1.0
