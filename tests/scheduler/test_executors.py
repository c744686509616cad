"""The executors' contract: LaunchExecutor launches in submit() and collects in result(), once."""

from __future__ import annotations

import threading

import pytest
import torch

from common.model.forward_batch import ForwardMode
from common.scheduler.executor import LaunchExecutor, StepResult, WorkerBatch


class RecordingWorker:
    """Logs launch/collect; launch of step_id 13 fails."""

    def __init__(self) -> None:
        self.log: list[str] = []

    @property
    def future_capacity(self) -> int:
        return 8

    def run(self, batch: WorkerBatch) -> StepResult:
        return self.collect(self.launch(batch))

    def launch(self, batch: WorkerBatch) -> int:
        if batch.step_id == 13:
            raise RuntimeError("launch failed")
        self.log.append(f"launch {batch.step_id}")
        return batch.step_id

    def collect(self, step_id: int) -> StepResult:
        self.log.append(f"collect {step_id}")
        return StepResult(next_token_ids=[step_id])


def batch(step_id: int) -> WorkerBatch:
    return WorkerBatch(ForwardMode.DECODE, [1], [0], [1], [0], [1], [0], [], [0], step_id=step_id)


def test_launch_in_submit_collect_once_in_result() -> None:
    worker = RecordingWorker()
    started: list[int] = []
    ex = LaunchExecutor(worker, on_thread_start=lambda: started.append(threading.get_ident()))
    first = ex.submit(batch(1))
    second = ex.submit(batch(2))
    assert worker.log == ["launch 1", "launch 2"] and not first.done()
    assert first.result().next_token_ids == [1] and first.result().next_token_ids == [1]
    assert second.result().next_token_ids == [2]
    assert worker.log == ["launch 1", "launch 2", "collect 1", "collect 2"]
    assert started == [threading.get_ident()]  # once, on the submitting thread


def test_a_failed_launch_reaches_result_and_the_next_step_runs() -> None:
    worker = RecordingWorker()
    ex = LaunchExecutor(worker)
    failed = ex.submit(batch(13))
    with pytest.raises(RuntimeError, match="launch failed"):
        failed.result()
    assert ex.submit(batch(14)).result().next_token_ids == [14]


def test_each_submitting_thread_gets_the_device_and_stream_once() -> None:
    started: list[int] = []
    ex = LaunchExecutor(RecordingWorker(), on_thread_start=lambda: started.append(threading.get_ident()))
    ex.submit(batch(1)).result()
    ex.submit(batch(2)).result()
    t = threading.Thread(target=lambda: ex.submit(batch(3)).result())
    t.start()
    t.join()
    assert started[0] == threading.get_ident() and len(started) == 2 and started[1] != started[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fetch_ring_copies_survive_newer_launches_and_refuse_a_late_wait() -> None:
    from common.model.cuda_streams import FETCH_SLOTS, CudaStreams

    streams = CudaStreams(torch.device("cuda"))
    copies = [streams.start_fetch([torch.full((3,), i, device="cuda"), torch.arange(2.0, device="cuda") + i])
              for i in range(FETCH_SLOTS)]
    assert [c.wait() for c in copies] == [[[i] * 3, [float(i), i + 1.0]] for i in range(FETCH_SLOTS)]
    late = copies[0]
    streams.start_fetch([torch.zeros(1, device="cuda")])  # reuses the first slot
    with pytest.raises(RuntimeError, match="reused its pinned buffer"):
        late.wait()
