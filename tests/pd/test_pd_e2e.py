"""1 prefill + 1 decode instance, real processes, real NIXL, tiny model (fp32).

The client plays the router: the same request and room go to both instances and
the tokens are read from decode's stream. Greedy outputs must equal transformers'
(and therefore the colocated instance's, which tests/engine and tests/server pin
to transformers), token for token. Sampled output (seeded, with penalties), logprobs
with their top-k, and stops are compared with the colocated engine's: the first token
is sampled on prefill and the rest on decode, so a seeded request must draw the same
noise at each step, decode's penalties must count the first token, and the first
token's logprobs and stop checks must travel with it.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from common.engine import Engine
from tests.engine.reference import hf_greedy
from tests.pd.pd_procs import PDPair, RoleProcess, start_pair, wait_healthy_or_stop

VOCAB = 384
SAMPLED = {"temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 1234, "frequency_penalty": 0.5,
           "presence_penalty": 0.3, "repetition_penalty": 1.2}


def workload(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(50)]
    prompts = []
    for i in range(n):
        body = [rng.randrange(3, VOCAB) for _ in range(rng.choice([1, 4, 15, 33, 64, 120]))]
        prompts.append(shared + body if i % 3 == 0 else body)
    return prompts


# page16-overlap's prefill and small_decode's: one start serves both
PREFILL16 = ["--page-size", "16", "--chunked-prefill-size", "32", "--max-total-tokens", "8192"]


def start_decode(prefill: RoleProcess, model_dir: Path, flags: list[str]) -> PDPair:
    decode = RoleProcess("decode_server", model_dir, "--dtype", "float32", *flags)
    wait_healthy_or_stop(decode)
    return PDPair(prefill, decode)


@pytest.fixture(scope="module")
def prefill16(tiny_llama_path: str) -> Iterator[RoleProcess]:
    role = RoleProcess("prefill_server", Path(tiny_llama_path), "--dtype", "float32", *PREFILL16)
    wait_healthy_or_stop(role)
    try:
        yield role
    finally:
        role.stop()


@pytest.fixture(scope="module", params=[(16, True), (16, False), (1, True), (1, False), (16, "one-thread")],
                ids=["page16-overlap", "page16-normal", "page1-overlap", "page1-normal", "page16-overlap-one-thread"])
def pair(request: pytest.FixtureRequest, tiny_llama_path: str) -> Iterator[PDPair]:
    page_size, overlap = request.param
    ps = str(page_size)
    # both loops on both page sizes (the overlap loop is the default); one-thread: as on CUDA
    loop = [] if overlap else ["--disable-overlap-schedule"]
    if overlap == "one-thread":
        loop = ["--overlap-worker-thread", "off"]
    decode = ["--page-size", ps, "--max-total-tokens", "8192", *loop]
    if request.param == (16, True):
        p = start_decode(request.getfixturevalue("prefill16"), Path(tiny_llama_path), decode)
        try:
            yield p
        finally:
            p.decode.stop()
        return
    p = start_pair(Path(tiny_llama_path), ["--page-size", ps, "--chunked-prefill-size", "32", "--max-total-tokens", "8192",
                                           *loop], decode)
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture(scope="module")
def colocated(tiny_llama_path: str) -> Iterator[Engine]:
    """The colocated engine on the same checkpoint: the reference for sampled output."""
    engine = Engine(tiny_llama_path, dtype="float32", page_size=4, chunked_prefill_size=32, max_total_tokens=4096)
    try:
        yield engine
        engine.check_integrity()
    finally:
        engine.shutdown()


def test_pd_greedy_equals_transformers(pair: PDPair, tiny_llama_path: str) -> None:
    prompts = workload(32, seed=3)
    bodies = [pair.body(p, 10, stream=i % 4 != 0) for i, p in enumerate(prompts)]
    results = pair.run(bodies)
    for prompt, res in zip(prompts, results, strict=True):
        assert res.error is None and res.prefill_status == 200 and res.decode_status == 200, res
        assert res.output_ids == hf_greedy(tiny_llama_path, prompt, 10)
        assert res.prefill_body["output_ids"] == [] and res.prefill_body["meta_info"]["prompt_tokens"] == len(prompt)
    # Round two shares long prefixes with round one: prefill's radix cache serves them, and
    # the cached-token count travels to decode in the aux row.
    second = [p + [11, 12] for p in prompts[:6]]
    results = pair.run([pair.body(p, 4) for p in second])
    for prompt, res in zip(second, results, strict=True):
        assert res.output_ids == hf_greedy(tiny_llama_path, prompt, 4)
    assert sum(r.events[-1]["meta_info"]["cached_tokens"] for r in results) > 0
    pair.wait_whole()


def test_pd_finishes_on_first_token_and_reports_metrics(pair: PDPair, tiny_llama_path: str) -> None:
    prompt = workload(1, seed=9)[0]
    (res,) = pair.run([pair.body(prompt, 1)])
    assert res.output_ids == hf_greedy(tiny_llama_path, prompt, 1)
    assert res.events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    pair.wait_whole()
    for name in ("num_bootstrap_queue_reqs", "num_inflight_queue_reqs", "kv_transfer_bytes",
                 "kv_transfer_transfers", "num_retractions_total"):
        assert pair.prefill.stat(name) is not None, name
    for name in ("num_prealloc_queue_reqs", "num_transfer_queue_reqs", "kv_transfer_bytes",
                 "num_retractions_total", "num_prebuilt_total"):
        assert pair.decode.stat(name) is not None, name
    assert (pair.prefill.stat("kv_transfer_bytes") or 0) > 0
    assert (pair.decode.stat("num_prebuilt_total") or 0) > 0
    decode_info = httpx.get(pair.decode.url + "/server_info", timeout=10.0).json()
    prefill_info = httpx.get(pair.prefill.url + "/server_info", timeout=10.0).json()
    assert decode_info["radix_cache"] is False and decode_info["pools"]["defer_frees"] == 1.0
    assert prefill_info["radix_cache"] is True and prefill_info["pools"]["defer_frees"] == 0.0


def test_seeded_sampling_with_penalties_equals_colocated(pair: PDPair, colocated: Engine) -> None:
    rng = random.Random(21)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 40, 77, 3)]
    params = [{**SAMPLED, "seed": 1000 + i} for i in range(len(prompts))]
    expected = colocated.generate(input_ids=prompts, sampling_params=[
        {"max_new_tokens": 16, "ignore_eos": True, **p} for p in params])
    greedy = colocated.generate(input_ids=prompts, sampling_params={"max_new_tokens": 16, "ignore_eos": True})
    results = pair.run([pair.body(prompt, 16, **p) for prompt, p in zip(prompts, params, strict=True)])
    for exp, res in zip(expected, results, strict=True):
        assert res.error is None, res.error
        assert res.output_ids == exp["output_ids"]
    assert any(e["output_ids"] != g["output_ids"] for e, g in zip(expected, greedy, strict=True)), "nothing was sampled"
    pair.wait_whole()


def test_logprobs_through_pd_equal_colocated(pair: PDPair, colocated: Engine) -> None:
    """Every token's logprob and top-k, the first one (sampled on prefill, carried in the aux
    row) included, equal the colocated engine's: one entry per output token, in order."""
    prompts = [list(range(10, 50)), list(range(60, 63))]
    expected = colocated.generate(input_ids=prompts, sampling_params={"max_new_tokens": 6, "temperature": 0,
                                                                    "ignore_eos": True},
                                  return_logprob=True, top_logprobs_num=3)
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


def test_stops_on_the_first_token_and_later_equal_colocated(pair: PDPair, colocated: Engine) -> None:
    """Stop strings and stop token ids matched on the first token (sampled on prefill) or on a
    later one (decode) end the request exactly where the colocated engine ends it."""
    prompts = [list(range(20, 60)), list(range(100, 131))]
    plain = colocated.generate(input_ids=prompts, sampling_params={"max_new_tokens": 8, "temperature": 0,
                                                                 "ignore_eos": True})
    cases = []
    for prompt, out in zip(prompts, plain, strict=True):
        ids, text = out["output_ids"], out["text"]
        cases += [(prompt, {"stop_token_ids": [ids[0]]}), (prompt, {"stop_token_ids": [ids[3]]})]
        if text.strip():
            cases += [(prompt, {"stop": [text.strip()[:1]]}), (prompt, {"stop": [text.strip()[-2:]]})]
    assert len(cases) >= 6
    expected = colocated.generate(input_ids=[p for p, _ in cases], sampling_params=[
        {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True, **extra} for _, extra in cases])
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


@pytest.fixture(scope="module")
def small_decode(prefill16: RoleProcess, tiny_llama_path: str) -> Iterator[PDPair]:
    """Decode pool of 256 tokens (16 pages of 16) and an optimistic reservation: admission
    over-commits, so the decode batch must retract; prefill's bootstrap queue holds what decode
    cannot take. (tests/pd/test_pd_multiturn.py retracts at page size 4.)"""
    p = start_decode(prefill16, Path(tiny_llama_path),
                     ["--page-size", "16", "--max-total-tokens", "256", "--num-reserved-decode-tokens", "0",
                      "--schedule-conservativeness", "0.3"])
    try:
        yield p
    finally:
        p.decode.stop()


def test_pd_retraction_keeps_outputs_exact(small_decode: PDPair, tiny_llama_path: str) -> None:
    rng = random.Random(4)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(30)] for _ in range(10)]
    # Any two of these at full length (30 + 100 tokens, 9 pages each) overflow the 16-page pool, so
    # decode retracts even when a slow machine feeds it one request at a time.
    results = small_decode.run([small_decode.body(p, 100) for p in prompts])
    for prompt, res in zip(prompts, results, strict=True):
        assert res.error is None, res.error
        assert res.output_ids == hf_greedy(tiny_llama_path, prompt, 100)
    assert (small_decode.decode.stat("num_retractions_total") or 0) > 0
    small_decode.wait_whole()


def test_pd_retraction_keeps_sampled_outputs_exact(small_decode: PDPair, colocated: Engine) -> None:
    """A retracted request is restored from its host copy with its sampler state: seeded
    sampling with penalties gives the colocated engine's tokens (no retraction there)."""
    rng = random.Random(7)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(30)] for _ in range(10)]
    params = [{**SAMPLED, "seed": 50 + i} for i in range(len(prompts))]
    before = small_decode.decode.stat("num_retractions_total") or 0
    expected = colocated.generate(input_ids=prompts, sampling_params=[
        {"max_new_tokens": 100, "ignore_eos": True, **p} for p in params])
    results = small_decode.run([small_decode.body(p, 100, **sp) for p, sp in zip(prompts, params, strict=True)])
    for exp, res in zip(expected, results, strict=True):
        assert res.error is None, res.error
        assert res.output_ids == exp["output_ids"]
    assert (small_decode.decode.stat("num_retractions_total") or 0) > before
    small_decode.wait_whole()


def test_pd_bootstrap_queue_holds_while_decode_is_full(small_decode: PDPair, tiny_llama_path: str) -> None:
    """Eight requests of 60 + 40 tokens at once on a 256-token decode pool: decode reserves pages
    for the first few only, the rest wait in its prealloc queue (counted once each), and their
    prefill holds them in its bootstrap queue (nothing to write into yet) until pages free up."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(60)] for _ in range(8)]
    waits = small_decode.decode.stat("num_prealloc_memory_waits_total") or 0
    results = small_decode.run([small_decode.body(p, 40) for p in prompts])
    for prompt, res in zip(prompts, results, strict=True):
        assert res.output_ids == hf_greedy(tiny_llama_path, prompt, 40)
    assert (small_decode.decode.stat("num_prealloc_memory_waits_total") or 0) > waits, "decode never held a request back"
    small_decode.wait_whole()
