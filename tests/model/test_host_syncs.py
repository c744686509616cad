"""The host-sync budget of a step (issue 20), counted on CPU so it cannot regress unseen.

A GPU step overlaps with the scheduler only if the host never waits for the device inside
it, except once, for the tokens it streams. tests/model/host_syncs.py counts every call that
would wait (item / tolist / cpu / bool() of a tensor, pageable host -> device copies, ...)
through one real engine: the tiny model, the torch attention backend and the flashinfer
backend (on its CPU stand-in), greedy and sampled rows, penalties, seeds and logprobs.
Budget: 1 fetch and 0 other syncs per decode step; 0 of either for a prompt chunk that
samples nothing.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest
import torch

from common.cache import ReqToTokenPool
from common.cache.kv_pool import KVPool
from common.engine import Engine
from common.model.attention import create_attention_backend
from common.model.device_streams import HostStreams
from common.model.forward_batch import ForwardMode
from common.model.testing import build_tiny_checkpoint
from common.sampling_params import SamplingParams
from common.scheduler.executor import StepHandle, WorkerBatch
from common.scheduler.req import Req
from tests.model import flashinfer_reference
from tests.model.host_syncs import HostSyncCounter

PARAMS = [
    SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True),
    SamplingParams(max_new_tokens=12, temperature=0.8, top_k=20, ignore_eos=True),
    SamplingParams(max_new_tokens=12, temperature=0.7, top_k=50, top_p=0.9, min_p=0.05, seed=11, ignore_eos=True),
    SamplingParams(max_new_tokens=12, temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.2, ignore_eos=True),
]


@dataclass
class StepCount:
    mode: ForwardMode | None
    samples: bool  # the step keeps a token of some request
    fetches: int
    syncs: dict[str, int]


@pytest.fixture(scope="module")
def head_dim_64_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_checkpoint(tmp_path_factory.mktemp("hd64-syncs"), "llama", hidden_size=128, num_heads=2,
                                     num_kv_heads=1))


def add_requests(engine: Engine, prompt_lens: list[int]) -> None:
    rng = random.Random(0)
    for i, n in enumerate(prompt_lens):
        engine.scheduler.add_request(Req(
            rid=f"r{i}", origin_input_ids=[rng.randrange(3, engine.vocab_size) for _ in range(n)],
            sampling_params=PARAMS[i % len(PARAMS)], stream=True, return_logprob=i % 3 == 0,
            top_logprobs_num=2 if i % 3 == 0 else 0,
        ))


def record_batches(engine: Engine) -> list[WorkerBatch]:
    """Every batch the scheduler submits from now on, in order."""
    submitted: list[WorkerBatch] = []
    submit = engine.core.executor.submit

    def recording_submit(batch: WorkerBatch) -> StepHandle:
        submitted.append(batch)
        return submit(batch)

    engine.core.executor.submit = recording_submit  # type: ignore[method-assign]
    return submitted


def counted_steps(engine: Engine, prompt_lens: list[int], exempt: Sequence[tuple[type, str]]) -> Iterator[StepCount]:
    """The normal loop, one step at a time: what each step costs."""
    add_requests(engine, prompt_lens)
    submitted = record_batches(engine)
    sched = engine.scheduler
    while sched.has_work:
        before = len(submitted)
        with HostSyncCounter(exempt) as c:
            sched.step()
        if len(submitted) == before:  # nothing left to run (a step that only resolves)
            yield StepCount(None, False, c.fetches, dict(c.syncs))
            continue
        batch = submitted[-1]
        yield StepCount(batch.mode, any(batch.samples or [True]), c.fetches, dict(c.syncs))
    engine.check_integrity()


def check_budget(engine: Engine, exempt: Sequence[tuple[type, str]] = ()) -> None:
    # page-crossing lengths and one prompt over the chunk size (its first chunk samples nothing)
    counts = list(counted_steps(engine, [5, 17, 40, 70, 3, 33], exempt))
    decode = [c for c in counts if c.mode is ForwardMode.DECODE]
    assert len(decode) >= 8
    assert [(c.fetches, c.syncs) for c in decode] == [(1, {})] * len(decode)
    assert [c.fetches for c in counts] == [int(c.samples) for c in counts]
    assert any(not c.samples for c in counts), "no prompt chunk without a sampled token ran"
    assert all(c.syncs == {} for c in counts), [c for c in counts if c.syncs]


def test_one_host_sync_per_decode_step_torch_backend(tiny_llama_path: str) -> None:
    engine = Engine(tiny_llama_path, dtype="float32", page_size=4, chunked_prefill_size=32, max_total_tokens=4096,
                    disable_overlap_schedule=True)
    try:
        check_budget(engine)
    finally:
        engine.shutdown()


def test_one_host_sync_per_decode_step_flashinfer_backend(monkeypatch: pytest.MonkeyPatch, head_dim_64_model: str) -> None:
    """ServerArgs keeps flashinfer off CPU: the engine's runner gets it swapped in instead."""
    flashinfer_reference.install(monkeypatch)
    engine = Engine(head_dim_64_model, dtype="bfloat16", page_size=16, chunked_prefill_size=32,
                    max_total_tokens=4096, attention_backend="torch", disable_overlap_schedule=True)
    try:
        runner = engine.core.runner
        runner.attn_backend = create_attention_backend(
            "flashinfer", shape=runner.attn_backend.shape, kv_pool=runner.kv_pool, req_to_token=runner.req_to_token,
            streams=runner.streams,
        )
        stand_in = [(cls, method) for cls in (flashinfer_reference.BatchDecodeWithPagedKVCacheWrapper,
                                              flashinfer_reference.BatchPrefillWithPagedKVCacheWrapper)
                    for method in ("plan", "run")]
        check_budget(engine, stand_in)
        assert any(name.endswith(".plan") for name, _, _ in flashinfer_reference.CALLS)
    finally:
        engine.shutdown()


def test_the_counter_sees_a_blocking_copy_and_a_read_back(tiny_llama_path: str) -> None:
    with HostSyncCounter() as c:
        x = torch.tensor([1, 2, 3], device="cpu")
        y = torch.tensor([4]).to("cpu")
        ok = bool((x > 0).all())
        x.sum().item()
    assert ok and y.shape == (1,)
    assert c.syncs == {"torch.tensor": 1, "Tensor.to": 1, "Tensor.__bool__": 1, "Tensor.item": 1}
    assert c.fetches == 0


@pytest.mark.parametrize("worker_thread", ["on", "off"])
def test_overlap_loop_stays_within_the_budget(tiny_llama_path: str, worker_thread: str) -> None:
    """The overlap loop, counted over a whole run (with a worker thread a step's work may end
    after the scheduler's step returns): one fetch per sampling batch, nothing else. On one
    thread (as on CUDA) each scheduler step also waits at most once: on the step before it."""
    engine = Engine(tiny_llama_path, dtype="float32", page_size=4, chunked_prefill_size=32, max_total_tokens=4096,
                    enable_cpu_overlap_schedule=True, overlap_worker_thread=worker_thread)
    try:
        add_requests(engine, [5, 17, 40, 70, 3, 33])
        submitted = record_batches(engine)
        per_step: list[int] = []
        with HostSyncCounter() as c:
            while engine.scheduler.has_work:
                before = c.fetches
                engine.scheduler.step()
                per_step.append(c.fetches - before)
            engine.core.executor.shutdown()  # joins the worker thread: every step has ended
        assert c.syncs == {}
        assert c.fetches == sum(any(b.samples or [True]) for b in submitted)
        assert sum(b.mode is ForwardMode.DECODE for b in submitted) >= 8
        if worker_thread == "off":
            assert max(per_step) == 1
        engine.check_integrity()
    finally:
        engine.shutdown()


class OrderingLog(HostStreams):
    """HostStreams that logs when the scheduler side orders itself after the worker."""

    def __init__(self, log: list[str]) -> None:
        super().__init__(torch.device("cpu"))
        self.log = log

    def scheduler_waits_for_worker(self) -> None:
        self.log.append("wait")


def test_scheduler_side_device_writes_wait_for_the_worker() -> None:
    """req_to_token zeroing and retraction's host copies run on the scheduler thread: on a GPU
    the worker's queued steps may still read those rows / pages, so each first orders itself
    after the worker stream (a device-side wait, not a host sync)."""
    log: list[str] = []
    pool = ReqToTokenPool(4, 32, streams=OrderingLog(log))
    row = pool.alloc()
    assert row is not None
    pool.write(row, 0, [16, 17, 18])
    table = pool.table
    pool.free(row)
    assert log == ["wait"] and not bool(table[row].any())
    pool.check_integrity()

    kv = KVPool(num_layers=2, num_pages=4, page_size=4, num_kv_heads=1, head_dim=8, dtype=torch.float32,
                streams=OrderingLog(log))
    slots = torch.tensor([4, 5])
    kv.kv[1, 1, 0, 0:2] = 1.5  # slots 4, 5 = page 1, offsets 0-1; layer 1's K
    k, v = kv.copy_slots_to_host(slots)
    assert log == ["wait", "wait"] and bool((k[1] == 1.5).all())
    kv.restore_slots_from_host(torch.tensor([8, 9]), k, v)
    assert log == ["wait"] * 3 and bool((kv.kv[2, 1, 0, 0:2] == 1.5).all())
