"""Prefill and decode at different TP sizes: (1, 2), (2, 1), (2, 2), real processes and NIXL.

One set of instances per page size serves every pair: prefill TP 1 and TP 2, decode TP 1 and
TP 2 (a TP 2 instance is rank 0 plus one rank process). The tiny llama has 2 KV heads, so a
TP 2 side holds one head per rank and each transfer cuts pages head-wise (TP 2 -> TP 2 moves
whole pages rank to rank). Greedy outputs equal transformers' (= colocated TP 1, pinned there
by tests/engine), with prompts longer than a prefill chunk and a second round that hits
prefill's prefix cache. Each rank's own NIXL agent registers only its own KV slice and writes
only its own heads (per-rank counters), and an injected WRITE failure on prefill rank 1 fails
that room alone. Last, kill -9 of decode TP 2's rank 1 mid-stream: the instance goes down
(/health fails), every client errors within the heartbeat bound, prefill leaks no page.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.engine.reference import hf_greedy
from tests.harness.process import wait_until
from tests.pd.inproc import InProcessPD
from tests.pd.pd_procs import PDPair, PDResult, RoleProcess
from tests.reliability.cluster import HB_INTERVAL_S, HB_TIMEOUT_S, HEARTBEAT_BOUND_S

VOCAB = 384
# Decode TP 2's forwards each take this much longer, so a long request is surely mid-stream
# when its rank is killed.
SLOW_STEP_S = 0.02


@dataclass
class Instances:
    prefill: dict[int, RoleProcess]  # by TP size
    decode: dict[int, RoleProcess]
    failed_write: PDResult | None = None  # page 1: the room whose write rank 1 failed (see fail_first_post)

    def pair(self, prefill_tp: int, decode_tp: int) -> PDPair:
        return PDPair(self.prefill[prefill_tp], self.decode[decode_tp])

    def all(self) -> list[RoleProcess]:
        return [*self.prefill.values(), *self.decode.values()]


@pytest.fixture(scope="module", params=[16, 1], ids=["page16", "page1"])
def instances(request: pytest.FixtureRequest, tiny_llama_path: str) -> Iterator[Instances]:
    model = Path(tiny_llama_path)
    ps = str(request.param)
    common = ["--dtype", "float32", "--page-size", ps, "--max-total-tokens", "4096",
              "--disaggregation-heartbeat-interval", str(HB_INTERVAL_S),
              "--disaggregation-heartbeat-timeout", str(HB_TIMEOUT_S)]
    prefill = [*common, "--chunked-prefill-size", "32"]
    fault = ["--disaggregation-fault-spec", "rank=1,fail_post_nth=1"] if request.param == 1 else []
    inst = Instances(
        prefill={1: RoleProcess("prefill_server", model, *prefill),
                 2: RoleProcess("prefill_server", model, *prefill, "--tp-size", "2", *fault)},
        decode={1: RoleProcess("decode_server", model, *common),
                2: RoleProcess("decode_server", model, *common, "--tensor-parallel-size", "2",
                               "--engine-fault-spec", f"slow_step_s={SLOW_STEP_S}")},
    )
    try:
        for role in inst.all():
            role.wait_healthy()
        if fault:
            inst.failed_write = fail_first_post(inst.pair(2, 2))
        yield inst
    finally:
        for role in inst.all():
            role.stop()


FAILED_PROMPT_SEED = 9


def fail_first_post(pair: PDPair) -> PDResult:
    """The first room through a prefill TP 2 whose rank 1 fails its first post: sent before any
    test writes through it, so no other test meets the injected failure."""
    assert pair.prefill.stat("kv_transfer_rank1_failed_posts") == 0
    (failed,) = pair.run([pair.body(workload(2, seed=FAILED_PROMPT_SEED)[0], 8)])
    return failed


def workload(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(40)]
    return [(shared if i % 2 == 0 else []) + [rng.randrange(3, VOCAB) for _ in range(rng.choice([1, 9, 33, 70]))]
            for i in range(n)]


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1), (2, 2)], ids=["tp1-tp2", "tp2-tp1", "tp2-tp2"])
def test_pd_across_tp_sizes_equals_transformers(instances: Instances, tiny_llama_path: str, prefill_tp: int,
                                                decode_tp: int) -> None:
    pair = instances.pair(prefill_tp, decode_tp)
    for role, tp in ((pair.prefill, prefill_tp), (pair.decode, decode_tp)):
        assert httpx.get(role.url + "/server_info", timeout=5.0).json()["pools"]["tp_size"] == tp
    prompts = workload(6, seed=prefill_tp * 10 + decode_tp)
    for prompt, res in zip(prompts, pair.run([pair.body(p, 8) for p in prompts]), strict=True):
        assert res.error is None and res.decode_status == 200, res
        assert res.output_ids == hf_greedy(tiny_llama_path, prompt, 8), f"prompt of {len(prompt)} tokens diverged"
    second = [p + [11, 12] for p in prompts[:3]]
    results = pair.run([pair.body(p, 4) for p in second])
    for prompt, res in zip(second, results, strict=True):
        assert res.output_ids == hf_greedy(tiny_llama_path, prompt, 4)
    assert sum(r.events[-1]["meta_info"]["cached_tokens"] for r in results) > 0  # prefill's prefix cache served
    pair.wait_whole()


def _pools(role: RoleProcess) -> dict[str, float]:
    return httpx.get(role.url + "/server_info", timeout=5.0).json()["pools"]  # type: ignore[no-any-return]


def _rank_moved(role: RoleProcess, tp: int) -> list[tuple[float, float]]:
    """(bytes, descriptors) each prefill rank's own agent wrote so far."""
    return [(role.stat(f"kv_transfer_rank{r}_bytes") or 0.0, role.stat(f"kv_transfer_rank{r}_descriptors") or 0.0)
            for r in range(tp)]


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1), (2, 2)], ids=["tp1-tp2", "tp2-tp1", "tp2-tp2"])
def test_each_rank_agent_registers_and_writes_only_its_own_heads(instances: Instances, prefill_tp: int,
                                                                 decode_tp: int) -> None:
    pair = instances.pair(prefill_tp, decode_tp)
    for role, tp in ((pair.prefill, prefill_tp), (pair.decode, decode_tp)):
        one_slice = _pools(role)["kv_pool_bytes"]  # rank 0's pool: one rank's heads
        for rank in range(tp):  # every rank's agent registered its own slice, and nothing more
            assert role.stat(f"kv_transfer_rank{rank}_registered_bytes") == one_slice, (role.module, rank)
        assert role.stat(f"kv_transfer_rank{tp}_registered_bytes") is None
    before = _rank_moved(pair.prefill, prefill_tp)
    results = pair.run([pair.body(p, 2) for p in workload(4, seed=3)])
    assert all(r.error is None for r in results), results
    moved = [(b - b0, d - d0) for (b, d), (b0, d0) in zip(_rank_moved(pair.prefill, prefill_tp), before, strict=True)]
    assert all(nbytes > 0 and ndescs > 0 for nbytes, ndescs in moved), moved
    if prefill_tp == 2:  # 2 KV heads: each rank holds one and wrote exactly that half of every page
        assert moved[0] == moved[1], moved
    pair.wait_whole()


def test_a_failed_write_of_prefill_rank_1_fails_its_room_only(instances: Instances, tiny_llama_path: str,
                                                              request: pytest.FixtureRequest) -> None:
    """Rank 1's agent fails its first post (injected, page 1's prefill TP 2, see fail_first_post):
    that room fails on both sides, rank 0 reports it only after its own writes settled, no page
    leaks, and the next room goes through."""
    if request.node.callspec.params["instances"] != 1:
        pytest.skip("once is enough: a failed post is the same at any page size")
    pair = instances.pair(2, 2)
    failed = instances.failed_write
    assert failed is not None
    assert failed.error is not None and failed.prefill_status >= 500, failed
    assert "injected" in str(failed.error) or "injected" in str(failed.prefill_body), failed
    assert pair.prefill.stat("kv_transfer_rank1_failed_posts") == 1
    prompt = workload(2, seed=FAILED_PROMPT_SEED)[0]
    (ok,) = pair.run([pair.body(prompt, 8)])
    assert ok.error is None and ok.output_ids == hf_greedy(tiny_llama_path, prompt, 8), ok
    pair.wait_whole()


def _rank_pids(engine_pid: int) -> list[int]:
    """The TP rank processes the engine spawned (not multiprocessing's resource tracker). Every
    thread's children: the overlap loop builds the engine (and spawns the ranks) on a thread
    of its own, and /proc lists a child under the thread that started it until that one exits."""
    children: list[str] = []
    for task in Path(f"/proc/{engine_pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a thread that just ended
            children += (task / "children").read_text().split()
    return [int(c) for c in children
            if b"spawn_main" in (cmd := Path(f"/proc/{c}/cmdline").read_bytes()) and b"resource_tracker" not in cmd]


def test_kill_one_decode_rank_mid_stream(instances: Instances, request: pytest.FixtureRequest) -> None:
    if request.node.callspec.params["instances"] != 16:
        pytest.skip("once is enough: the rank dies the same way at any page size")
    pair = instances.pair(1, 2)
    decode = pair.decode
    (rank1,) = _rank_pids(decode.engine_pid())
    prompts = workload(3, seed=5)
    results: list[PDResult] = []
    runner = threading.Thread(target=lambda: results.extend(pair.run([pair.body(p, 600) for p in prompts])))
    runner.start()
    # 600 forwards of >= SLOW_STEP_S each: all three stay mid-stream long after they reach this state
    assert wait_until(lambda: decode.stat("num_running_reqs") == 3, 60.0, period_s=0.1), decode.log()[-3000:]
    killed_at = time.monotonic()
    os.kill(rank1, signal.SIGKILL)
    runner.join(HEARTBEAT_BOUND_S)
    assert not runner.is_alive(), f"clients still waiting {HEARTBEAT_BOUND_S}s after the kill"
    assert time.monotonic() - killed_at <= HEARTBEAT_BOUND_S
    for res in results:
        assert res.error is not None, f"a client of the dead decode got no error: {res}"
        assert len(res.output_ids) < 600
    assert not decode.healthy()
    assert wait_until(lambda: decode.proc.poll() is not None or not os.path.exists(f"/proc/{rank1}"), 10.0)
    prefill = pair.prefill
    assert wait_until(lambda: prefill.stat("kv_pages_in_use") == 0 and prefill.stat("num_inflight_queue_reqs") == 0
                      and prefill.stat("num_bootstrap_queue_reqs") == 0, HEARTBEAT_BOUND_S), prefill.log()[-2000:]


def test_tp2_decode_retracts_every_ranks_heads_and_restores_them(tiny_llama_path: str) -> None:
    """A decode TP 2 pool too small for three requests (17 pages of 4): decode retracts, its host
    copy holds both ranks' heads (rank 0 reads rank 1's pool through its mapping), and the
    restored requests still decode transformers' tokens."""
    pd = InProcessPD(tiny_llama_path, decode_args={"max_total_tokens": 68, "num_reserved_decode_tokens": 1,
                                                    "tp_size": 2})
    try:
        prompts = {f"r{i}": [random.Random(i).randrange(5, 200) for _ in range(12)] for i in range(3)}
        for rid, prompt in prompts.items():
            pd.submit(rid, prompt, 40, ignore_eos=True)
        pd.run_until_finished(list(prompts))
        assert pd.decode.scheduler.num_retractions > 0, "the pool was meant to be too small for all three"
        for rid, prompt in prompts.items():
            assert pd.tokens(rid) == hf_greedy(tiny_llama_path, prompt, 40), rid
    finally:
        pd.close()


def test_a_rank_dead_before_joining_fails_the_start_at_once(tiny_llama_path: str) -> None:
    """Rank 0 waits for the other ranks inside torch.distributed's rendezvous, which would hold
    a rank that never joins for the whole start timeout; the start watch ends it at once."""
    start_timeout_s = 60.0
    inst = RoleProcess("common.server", Path(tiny_llama_path), "--dtype", "float32", "--tp-size", "2",
                       "--engine-start-timeout", str(start_timeout_s))
    try:
        ranks: list[tuple[int, int]] = []  # (engine, rank)

        def rank_spawned() -> bool:
            engines = Path(f"/proc/{inst.proc.pid}/task/{inst.proc.pid}/children").read_text().split()
            ranks.extend((int(e), r) for e in engines if os.path.exists(f"/proc/{e}") for r in _rank_pids(int(e)))
            return bool(ranks)

        assert wait_until(rank_spawned, start_timeout_s, period_s=0.02), inst.log()[-2000:]
        engine, rank = ranks[0]
        os.kill(rank, signal.SIGKILL)  # it is still importing: it cannot have joined yet
        # the engine ends well before the start timeout (its frontend then fails the start)
        assert wait_until(lambda: not os.path.exists(f"/proc/{engine}/status") or "zombie" in Path(
            f"/proc/{engine}/status").read_text(), start_timeout_s / 2), inst.log()[-2000:]
        assert "while the instance was starting" in inst.log()
    finally:
        inst.kill9()  # the frontend would finish loading its tokenizer before it exits
        inst.stop()
