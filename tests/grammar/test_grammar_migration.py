"""A constrained request migrated after a decode failure: the router's next attempt carries
grammar_prefix_len = the tokens generated so far, and an engine replays them into its matcher, so
the continuation equals the unmigrated request's (greedy, fp32)."""

from __future__ import annotations

import msgspec
import pytest

from common.engine import Engine
from router.migration import Migration
from router.plan import GenerationPlan
from router.upstream import WorkerEvent
from tests.grammar.reference import CONSTRAINTS


def test_next_plan_carries_the_grammar_prefix() -> None:
    sp = {"max_new_tokens": 40, "regex": CONSTRAINTS["regex"]}
    plan = GenerationPlan("generate", "m", [1, 2, 3], sp, True)
    mig = Migration(plan, max_migrations=2)
    for ids in ([7, 8], [9]):
        data = {"output_ids": ids}
        mig.record(WorkerEvent(msgspec.json.encode(data), data))
    nxt = mig.next_plan()
    assert nxt.input_ids == [1, 2, 3, 7, 8, 9]
    assert nxt.sampling_params["grammar_prefix_len"] == 3 and nxt.sampling_params["max_new_tokens"] == 37
    data = {"output_ids": [4]}
    mig.record(WorkerEvent(msgspec.json.encode(data), data))
    assert mig.next_plan().sampling_params["grammar_prefix_len"] == 4  # counted from the original prompt


@pytest.mark.parametrize("kind", ["json_schema", "ebnf"])
def test_replayed_prefix_continues_exactly(tiny_llama_path: str, kind: str) -> None:
    engine = Engine(tiny_llama_path, dtype="float32", page_size=4, max_total_tokens=2048)
    try:
        prompt = [5, 17, 99, 42, 8]
        params = {"max_new_tokens": 30, "temperature": 0, kind: CONSTRAINTS[kind]}
        whole = engine.generate(input_ids=prompt, sampling_params=params)["output_ids"]  # type: ignore[call-overload]
        cut = min(6, len(whole) - 2)
        assert cut >= 2, whole
        resumed = engine.generate(input_ids=prompt + whole[:cut], sampling_params={
            **params, "max_new_tokens": 30 - cut, "grammar_prefix_len": cut})
        assert resumed["output_ids"] == whole[cut:]  # type: ignore[call-overload]
        # a prefix the grammar refuses is a 400, not a silently restarted grammar
        eos = min(engine.eos_token_ids)  # the grammar is not complete after one token: its end is refused
        bad = engine.generate(input_ids=prompt + [whole[0], eos], sampling_params={
            **params, "grammar_prefix_len": 2})
        assert "not allowed" in bad["meta_info"]["finish_reason"]["message"]  # type: ignore[call-overload]
        engine.check_integrity()
    finally:
        engine.shutdown()
