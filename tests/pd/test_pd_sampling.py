"""Seeded sampling through PD equals the colocated engine's, token for token.

The first token is sampled on prefill and the rest on decode; a seeded request must draw
the same noise at each step (the step count starts at 1 on decode) and decode's penalties
must count the first token, or PD output differs from the colocated instance's."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.engine import Engine
from tests.pd.pd_procs import PDPair, start_pair

VOCAB = 384
SAMPLED = {"temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 1234, "frequency_penalty": 0.5,
           "presence_penalty": 0.3, "repetition_penalty": 1.2}


@pytest.fixture(scope="module")
def pair(tiny_llama_path: str) -> Iterator[PDPair]:
    p = start_pair(Path(tiny_llama_path), ["--page-size", "4", "--chunked-prefill-size", "32"], ["--page-size", "4"])
    try:
        yield p
    finally:
        p.stop()


def test_seeded_sampling_with_penalties_equals_colocated(pair: PDPair, tiny_llama_path: str) -> None:
    rng = random.Random(21)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 40, 77, 3)]
    params = [{**SAMPLED, "seed": 1000 + i} for i in range(len(prompts))]
    engine = Engine(tiny_llama_path, dtype="float32", page_size=4, chunked_prefill_size=32, max_total_tokens=4096)
    try:
        expected = engine.generate(input_ids=prompts, sampling_params=[
            {"max_new_tokens": 16, "ignore_eos": True, **p} for p in params])
        greedy = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 16, "ignore_eos": True})
        engine.check_integrity()
    finally:
        engine.shutdown()
    results = pair.run([pair.body(prompt, 16, **p) for prompt, p in zip(prompts, params, strict=True)])
    for exp, res in zip(expected, results, strict=True):
        assert res.error is None, res.error
        assert res.output_ids == exp["output_ids"]
    assert any(e["output_ids"] != g["output_ids"] for e, g in zip(expected, greedy, strict=True)), "nothing was sampled"
    pair.wait_whole()


def test_logprobs_through_pd_equal_colocated(pair: PDPair, tiny_llama_path: str) -> None:
    """Every token's logprob and top-k, the first one (sampled on prefill, carried in the aux
    row) included, equal the colocated engine's: one entry per output token, in order."""
    prompts = [list(range(10, 50)), list(range(60, 63))]
    engine = Engine(tiny_llama_path, dtype="float32", page_size=4, chunked_prefill_size=32, max_total_tokens=4096)
    try:
        expected = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 6, "temperature": 0,
                                                                     "ignore_eos": True},
                                   return_logprob=True, top_logprobs_num=3)
    finally:
        engine.shutdown()
    bodies = []
    for i, prompt in enumerate(prompts):
        body = pair.body(prompt, 6, stream=i == 0)
        body.update(return_logprob=True, top_logprobs_num=3)
        bodies.append(body)
    for exp, res in zip(expected, pair.run(bodies), strict=True):
        assert res.error is None, res.error
        assert res.output_ids == exp["output_ids"]
        got_lp = [x for ev in res.events for x in ev["meta_info"]["output_token_logprobs"]]
        got_top = [x for ev in res.events for x in ev["meta_info"]["output_top_logprobs"]]
        want_lp, want_top = exp["meta_info"]["output_token_logprobs"], exp["meta_info"]["output_top_logprobs"]
        assert len(got_lp) == len(got_top) == len(exp["output_ids"]) == 6
        assert [t for _, t in got_lp] == [t for _, t in want_lp] == res.output_ids
        assert [lp for lp, _ in got_lp] == pytest.approx([lp for lp, _ in want_lp], abs=1e-4)
        for got_k, want_k in zip(got_top, want_top, strict=True):
            assert [t for _, t in got_k] == [t for _, t in want_k]
            assert [lp for lp, _ in got_k] == pytest.approx([lp for lp, _ in want_k], abs=1e-4)
    pair.wait_whole()


def test_stops_on_the_first_token_and_later_equal_colocated(pair: PDPair, tiny_llama_path: str) -> None:
    """Stop strings and stop token ids matched on the first token (sampled on prefill) or on a
    later one (decode) end the request exactly where the colocated engine ends it."""
    prompts = [list(range(20, 60)), list(range(100, 131))]
    engine = Engine(tiny_llama_path, dtype="float32", page_size=4, chunked_prefill_size=32, max_total_tokens=4096)
    try:
        plain = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 8, "temperature": 0,
                                                                  "ignore_eos": True})
        cases = []
        for prompt, out in zip(prompts, plain, strict=True):
            ids, text = out["output_ids"], out["text"]
            cases += [(prompt, {"stop_token_ids": [ids[0]]}), (prompt, {"stop_token_ids": [ids[3]]})]
            if text.strip():
                cases += [(prompt, {"stop": [text.strip()[:1]]}), (prompt, {"stop": [text.strip()[-2:]]})]
        assert len(cases) >= 6
        expected = engine.generate(input_ids=[p for p, _ in cases], sampling_params=[
            {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True, **extra} for _, extra in cases])
        engine.check_integrity()
    finally:
        engine.shutdown()
    bodies = [pair.body(prompt, 8, stream=i % 2 == 0, **extra) for i, (prompt, extra) in enumerate(cases)]
    for (_, extra), exp, res in zip(cases, expected, pair.run(bodies), strict=True):
        assert res.error is None, res.error
        assert exp["meta_info"]["finish_reason"]["type"] == "stop", (extra, exp)
        last = res.events[-1]["meta_info"]
        assert last["finish_reason"] == exp["meta_info"]["finish_reason"], extra
        assert "".join(ev["text"] for ev in res.events) == exp["text"], extra
        assert last["completion_tokens"] == exp["meta_info"]["completion_tokens"], extra
        assert res.output_ids == exp["output_ids"], extra
    pair.wait_whole()
