"""bench/overlap_sim.py: the overlap loop launches step N+1 before it collects step N.

The simulated device (common/scheduler/sim_device.py) runs each forward D ms on a thread that
sleeps, while the host's share of a step is H ms of busy work. The order of launch/collect
events is checked exactly; the step times at 10x the issue's (H, D) against the host share each
run really took (a collect's return -> the next launch: H, or more where a loaded 2-core box
slowed the scheduler's bookkeeping), so load moves the bound with the step instead of flipping
the verdict.
"""

from __future__ import annotations

import bench_fakes  # noqa: F401  (puts bench/ on sys.path)
import pytest
from overlap_sim import host_ms_per_step, run_sim

from common.scheduler.sim_device import SimEvent

SCALE = 10


def _order(timeline: list[SimEvent], what: str) -> dict[int, int]:
    return {e.step_id: i for i, e in enumerate(timeline) if e.what == what}


@pytest.mark.parametrize("host_ms,device_ms", [(1, 3), (3, 1), (2, 2)])
def test_overlap_loop_takes_the_longer_of_host_and_device(host_ms: int, device_ms: int) -> None:
    h, d = SCALE * host_ms, SCALE * device_ms
    overlap = run_sim(h, d, overlap=True, batch=4, steps=24)
    normal = run_sim(h, d, overlap=False, batch=4, steps=24)
    assert overlap.tokens_ok and normal.tokens_ok  # same tokens as the fake model's reference

    launch, collect = _order(overlap.timeline, "launch"), _order(overlap.timeline, "collect")
    steps = sorted(collect)
    decode_pairs = list(zip(steps[3:-1], steps[4:], strict=True))
    assert decode_pairs
    assert all(launch[b] < collect[a] for a, b in decode_pairs), "overlap: step N+1 launched after collecting N"
    n_launch, n_collect = _order(normal.timeline, "launch"), _order(normal.timeline, "collect")
    assert all(n_collect[a] < n_launch[b] for a, b in zip(steps[:-1], steps[1:], strict=True))

    assert overlap.host_ms >= 0.95 * h and normal.host_ms >= 0.95 * h  # the host did pay H
    bound, total = max(overlap.host_ms, d), normal.host_ms + d
    assert overlap.step_ms <= 1.1 * bound + 1.0, (overlap.step_ms, overlap.host_ms, d)
    assert normal.step_ms >= 0.95 * total, (normal.step_ms, normal.host_ms, d)
    assert overlap.step_ms < normal.step_ms


def test_host_cost_per_step_with_a_zero_cost_forward_is_measured() -> None:
    assert 0 < host_ms_per_step(1, steps=5) < 1000


def test_sampling_tensors_are_reused_only_while_the_batch_is_unchanged() -> None:
    """TorchModelWorker stages a batch's sampling tensors once for a run of equal steps."""
    import torch
    from overlap_sim import ZeroCostRunner

    from common.model.sampler import Sampler
    from common.sampling_params import SamplingParams
    from common.scheduler.executor import SamplingRow
    from common.scheduler.model_worker import TorchModelWorker

    worker = TorchModelWorker(ZeroCostRunner(64, 4, torch.zeros(4, 8, dtype=torch.int64)),  # type: ignore[arg-type]
                              Sampler(64, 4), future_capacity=8)
    greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=0.7)
    first = worker._sampling_info([SamplingRow(greedy, 0, 0), SamplingRow(greedy, 1, 0)])
    assert worker._sampling_info([SamplingRow(greedy, 0, 1), SamplingRow(greedy, 1, 1)]) is first
    changed = worker._sampling_info([SamplingRow(hot, 0, 2), SamplingRow(greedy, 1, 2)])
    assert changed is not first and not changed.is_all_greedy
    fewer = worker._sampling_info([SamplingRow(greedy, 1, 3)])
    assert fewer.rows_cpu == [1] and fewer.is_all_greedy
