"""Request migration against stub workers: a stream whose decode fails after the first byte goes
on from another pair, with no gap, no repeated token, one [DONE] and the client's usage.

The stub's tokens are a function of the context alone (stub_worker.next_token), as greedy
decoding is, so a migrated stream must equal the undisturbed one token for token.
"""

from __future__ import annotations

import json

import httpx

from tests.router.router_procs import Cluster, RouterProc, pd_args
from tests.router.stub_worker import generate_ids, token_text

PROMPT = [5, 6, 7, 8]


def stream(r: RouterProc, body: dict[str, object], path: str = "/v1/completions") -> list[str]:
    with httpx.stream("POST", r.url + path, json={**body, "stream": True}, timeout=30) as resp:
        assert resp.status_code == 200, resp.read()
        return [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]


def test_migration_continues_the_stream(cluster: Cluster) -> None:
    p, d1, d2 = cluster.stubs("prefill", "decode", "decode")
    common = ["--decode-policy", "round_robin", "--health-check-interval", "0.2"]
    r1 = cluster.router(pd_args([p], [d1, d2], *common))
    r0 = cluster.router(pd_args([p], [d1, d2], *common, "--max-migrations", "0"))
    r1.wait_ready()
    r0.wait_ready()
    want = generate_ids(PROMPT, 8)

    # d1 (round robin's first pick) fails in-band after 3 tokens: the stream moves to d2.
    d1.control(error_after_tokens=3)
    d2.reset()
    events = stream(r1, {"prompt": PROMPT, "max_tokens": 8, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), chunks
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == "".join(token_text(t) for t in want)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["usage"]["prompt_tokens"] == len(PROMPT)
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    moved = d2.stats()["last_body"]
    assert moved["input_ids"] == PROMPT + want[:3] and moved["sampling_params"]["max_new_tokens"] == 5
    assert "router_migrations_total" in httpx.get(r1.url + "/metrics").text

    # Native /generate, delta stream: the ids and the completion count go on from the cut.
    events = stream(r1, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8},
                         "incremental_stream": True}, "/generate")
    ids = [i for e in events[:-1] for i in json.loads(e)["output_ids"]]
    assert ids == want and events[-1] == "[DONE]"
    assert json.loads(events[-2])["meta_info"]["completion_tokens"] == 8
    assert json.loads(events[-2])["meta_info"]["prompt_tokens"] == len(PROMPT)

    # Both decodes fail: one migration, then the in-band error (the budget is spent).
    d2.control(error_after_tokens=2)
    events = stream(r1, {"prompt": PROMPT, "max_tokens": 8})
    assert "error" in json.loads(events[-2]) and events[-1] == "[DONE]"
    assert sum(len(json.loads(e)["choices"]) for e in events[:-2]) == 5  # 3 from d1, 2 from d2

    # --max-migrations 0: today's behaviour, the error ends the stream.
    d2.control(error_after_tokens=None)
    events = stream(r0, {"prompt": PROMPT, "max_tokens": 8})
    assert "error" in json.loads(events[-2]) and events[-1] == "[DONE]"
    assert sum(len(json.loads(e)["choices"]) for e in events[:-2]) == 3

    # Stop strings: never migrated (text held back at the cut could be lost), the error ends it.
    d1.control(error_after_tokens=3)
    d2.control(error_after_tokens=3)
    events = stream(r1, {"prompt": PROMPT, "max_tokens": 8, "stop": ["never-matches"]})
    assert "error" in json.loads(events[-2]) and events[-1] == "[DONE]"
    assert sum(len(json.loads(e)["choices"]) for e in events[:-2]) == 3
    d2.control(error_after_tokens=None)

    # A decode that dies mid-stream (connection lost) is migrated too.
    d1.control(error_after_tokens=None, die_after_tokens=2)
    events = stream(r1, {"prompt": PROMPT, "max_tokens": 8})
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), chunks
    assert "".join(c["choices"][0]["text"] for c in chunks) == "".join(token_text(t) for t in want)
    for r in (r0, r1):
        assert all(w["in_flight_requests"] == 0 for w in r.workers().values())


def test_shifted_seed_continues_the_sampler_noise() -> None:
    from common.model.sampler import _mix
    from router.migration import shifted_seed

    for seed in (0, 1, 42, -5, 2**63 - 1, -(2**63)):
        for k in (1, 7, 1000):
            s = shifted_seed(seed, k)
            assert -(2**63) <= s < 2**63
            assert [_mix(s, j) for j in range(5)] == [_mix(seed, k + j) for j in range(5)]
