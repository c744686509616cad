"""Scheduler with the fake worker: every state, every policy, exact outputs, whole pools."""

from __future__ import annotations

import pytest

from common.model.forward_batch import ForwardMode
from common.scheduler.fake_worker import reference_generate
from common.scheduler.new_token_ratio import NewTokenRatioTracker
from common.scheduler.req import ReqState
from tests.scheduler.helpers import EOS, LOOPS, VOCAB, make_harness, make_req, mixed_workload


def run_workload(h, workload, *, ignore_eos=True):
    for rid, prompt, n in workload:
        h.scheduler.add_request(make_req(rid, prompt, n, ignore_eos=ignore_eos))
    h.scheduler.run_until_idle()
    for rid, prompt, n in workload:
        expected = reference_generate(prompt, n, VOCAB, frozenset() if ignore_eos else EOS)
        assert h.tokens(rid) == expected, rid
        assert h.final(rid).completion_tokens == len(expected)
    h.check()


@pytest.mark.parametrize("overlap", LOOPS)
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("policy", ["fcfs", "lpm", "lof", "random", "priority"])
def test_outputs_exact_all_policies(overlap, page_size, policy):
    h = make_harness(page_size=page_size, num_pages=4096 // page_size, overlap=overlap, schedule_policy=policy,
                     chunked_prefill_size=32, max_prefill_tokens=96)
    run_workload(h, mixed_workload(24, seed=page_size))


@pytest.mark.parametrize("overlap", LOOPS)
def test_mixed_chunk_outputs_exact(overlap):
    h = make_harness(page_size=4, num_pages=1024, overlap=overlap, chunked_prefill_size=16, enable_mixed_chunk=True)
    modes = []
    launch = h.scheduler._launch
    h.scheduler._launch = lambda b: (modes.append(b.mode), launch(b))  # type: ignore[method-assign]
    run_workload(h, mixed_workload(20, seed=9))
    assert ForwardMode.MIXED in modes


def test_prefix_cache_hits_second_round():
    h = make_harness(page_size=4, num_pages=1024, chunked_prefill_size=64)
    wl = mixed_workload(8, seed=1)
    run_workload(h, wl)
    wl2 = [(rid + "b", prompt + [5, 6, 7], n) for rid, prompt, n in wl]
    run_workload(h, wl2)
    cached = [h.final(rid).cached_tokens for rid, _, _ in wl2]
    assert all(c >= len(p) // 4 * 4 - 4 for c, (_, p, _) in zip(cached, wl2, strict=True)), cached


def test_eos_stops_and_threaded_overlap():
    h = make_harness(page_size=4, overlap=True, threaded=True)
    run_workload(h, mixed_workload(16, seed=3), ignore_eos=False)
    h.scheduler.executor.shutdown()


@pytest.mark.parametrize("overlap", LOOPS)
def test_retraction_keeps_outputs_exact(overlap):
    # 40 pages x 4 tokens: far less than 16 requests x ~100 tokens.
    h = make_harness(page_size=4, num_pages=48, chunked_prefill_size=32, schedule_policy="fcfs", overlap=overlap)
    wl = [(f"r{i}", [10 + i] * 20, 60) for i in range(16)]
    run_workload(h, wl)
    assert h.scheduler.num_retractions > 0


def test_max_new_tokens_one_and_zero_budget_requests():
    h = make_harness()
    run_workload(h, [("a", [5, 6, 7], 1), ("b", [8] * 30, 1), ("c", [9, 9], 2)])


def test_rejects_bad_requests():
    h = make_harness(context_length=64)
    with pytest.raises(ValueError, match="empty"):
        h.scheduler.add_request(make_req("e", []))
    with pytest.raises(ValueError, match="context length"):
        h.scheduler.add_request(make_req("l", [1] * 64))
    h.scheduler.add_request(make_req("ok", [1, 2, 3], 4))
    with pytest.raises(ValueError, match="duplicate"):
        h.scheduler.add_request(make_req("ok", [1, 2, 3], 4))
    h.scheduler.run_until_idle()
    h.check()


def _abort_first(h, predicate, max_steps=2000):
    """Step until some live request satisfies predicate, abort it, return its rid."""
    s = h.scheduler
    for _ in range(max_steps):
        for rid, req in list(s.reqs.items()):
            if predicate(req):
                assert s.abort(rid, "test abort")
                assert req.finish_reason is not None and req.finish_reason.type == "abort"
                return rid
        s.step()
    raise AssertionError("no request reached the state")


@pytest.mark.parametrize("overlap", LOOPS)
@pytest.mark.parametrize(
    "state", [ReqState.WAITING, ReqState.CHUNKED, ReqState.RUNNING, ReqState.RETRACTED]
)
def test_abort_in_each_state(overlap, state):
    h = make_harness(page_size=4, num_pages=48 if state is ReqState.RETRACTED else 512, overlap=overlap,
                     chunked_prefill_size=16, max_running_requests=4, schedule_policy="fcfs")
    s = h.scheduler
    wl = [(f"r{i}", [20 + i] * (20 + 7 * i), 60) for i in range(8)]
    for rid, p, n in wl:
        s.add_request(make_req(rid, p, n))
    target = _abort_first(h, lambda r: r.state is state)
    s.run_until_idle()
    assert h.final(target).finish_reason.type == "abort"
    for rid, p, n in wl:
        if rid != target:
            assert h.tokens(rid) == reference_generate(p, n, VOCAB), rid
    h.check()
    assert not s.abort(target)  # a second abort is a no-op


def test_new_token_ratio_rule():
    t = NewTokenRatioTracker(init=0.7, min_factor=0.14, decay_steps=600, retract_steps=20)
    assert t.value == pytest.approx(0.7)
    for _ in range(300):
        t.on_decode_step()
    assert t.value == pytest.approx(0.7 - 300 * (0.7 - 0.098) / 600)
    for _ in range(1000):
        t.on_decode_step()
    assert t.value == pytest.approx(0.098)
    t.on_retract([10, 30], [100, 200])
    assert t.value == pytest.approx(min(1.0, (40 + 20 * 2) / 301))
    t.on_idle()
    assert t.value == pytest.approx(0.7)
    t.on_retract([100], [100])
    assert t.value == 1.0


def test_finished_request_not_decoded_twice_in_overlap():
    h = make_harness(page_size=1, overlap=True)
    s = h.scheduler
    s.add_request(make_req("a", [4, 5, 6], 3))
    s.add_request(make_req("b", [4, 5, 9], 10))
    s.run_until_idle()
    assert len(h.tokens("a")) == 3 and len(h.tokens("b")) == 10
    finals = [o for o in h.outputs["a"] if o.finish_reason is not None]
    assert len(finals) == 1
    h.check()


@pytest.mark.parametrize("overlap", LOOPS)
def test_deferred_frees_keep_outputs_and_pools(overlap):
    """PD decode mode: freed pages wait for the step in flight; nothing leaks at idle."""
    h = make_harness(page_size=4, num_pages=64, overlap=overlap, chunked_prefill_size=16, schedule_policy="fcfs")
    h.scheduler.kv.defer_frees = True
    wl = [(f"r{i}", [30 + i] * (10 + 5 * i), 30) for i in range(10)]
    run_workload(h, wl)
    assert not h.scheduler.kv.deferred_pages


def test_request_whose_budget_exceeds_the_pool_still_runs_alone():
    """A request reserving more than the whole pool must not wait forever: alone it is admitted,
    and if it outgrows the pool it ends with a clear error instead of hanging."""
    h = make_harness(page_size=4, num_pages=20, chunked_prefill_size=16)  # 76 usable slots
    h.scheduler.add_request(make_req("big", [9] * 30, 40))  # 30 + 40 fits, reservation would not
    h.scheduler.add_request(make_req("huge", [8] * 30, 500))  # cannot fit: must error, not hang
    h.scheduler.run_until_idle()
    assert h.tokens("big") == reference_generate([9] * 30, 40, VOCAB)
    final = h.final("huge")
    assert final.finish_reason.type == "abort" and "KV memory" in final.finish_reason.message
    h.check()
