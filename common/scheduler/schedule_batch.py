"""A scheduled step: the requests in it, and the WorkerBatch built from them."""

from __future__ import annotations

from dataclasses import dataclass

from common.model.forward_batch import ForwardMode
from common.scheduler.executor import SamplingRow, WorkerBatch, placeholder
from common.scheduler.kv_manager import SlotWrite
from common.scheduler.req import Req


@dataclass
class ScheduleBatch:
    mode: ForwardMode
    reqs: list[Req]
    samples_token: list[bool]  # False for a non-final prefill chunk (its sampled token is discarded)
    worker_batch: WorkerBatch
    num_prefill_reqs: int = 0  # reqs[:num_prefill_reqs] extend a prompt; the rest decode (MIXED)

    def is_prompt(self, i: int) -> bool:
        return i < self.num_prefill_reqs

    @property
    def is_extend(self) -> bool:
        return self.mode is not ForwardMode.DECODE


class BatchBuilder:
    """Turns requests whose slots are already allocated into a WorkerBatch.

    For each request the step computes tokens [start, start + n) of its sequence,
    start = kv_len - n after allocation. Token ids come from fill_ids when known,
    else from the FutureMap (the newest pending token).
    """

    @staticmethod
    def build(
        mode: ForwardMode,
        reqs: list[Req],
        extend_lens: list[int],
        samples_token: list[bool],
        future_indices: list[int],
        slot_writes: list[SlotWrite],
        step_id: int,
        num_prefill_reqs: int = 0,
    ) -> ScheduleBatch:
        input_ids: list[int] = []
        positions: list[int] = []
        out_loc: list[int] = []
        seq_lens: list[int] = []
        prefix_lens: list[int] = []
        sampling: list[SamplingRow] = []
        for req, n, samples, fi in zip(reqs, extend_lens, samples_token, future_indices, strict=True):
            start = req.kv_len - n
            prompt, out = req.origin_input_ids, req.output_ids  # not fill_ids: no copy per step
            num_prompt, num_known = len(prompt), len(prompt) + len(out)
            for pos in range(start, start + n):
                if pos < num_prompt:
                    input_ids.append(prompt[pos])
                elif pos < num_known:
                    input_ids.append(out[pos - num_prompt])
                else:
                    assert pos == num_known and req.last_future is not None, f"token {pos} unknown: {req}"
                    input_ids.append(placeholder(req.last_future))
            positions.extend(range(start, start + n))
            out_loc.extend(req.kv_slots[start : start + n])
            seq_lens.append(req.kv_len)
            prefix_lens.append(start)
            assert req.req_pool_idx is not None
            reset = req.needs_sampler_reset
            req.needs_sampler_reset = False
            lp_offset, lp_targets = req.prompt_logprob_targets(start, n) if req.wants_prompt_logprobs else (0, [])
            sampling.append(
                SamplingRow(
                    params=req.sampling_params,
                    row=req.req_pool_idx,
                    step=req.num_output_scheduled,
                    return_logprob=req.return_logprob,
                    top_logprobs_num=req.top_logprobs_num,
                    reset_prompt=list(req.origin_input_ids) if reset else None,
                    reset_outputs=list(req.output_ids) if reset else None,
                    prompt_logprob_offset=lp_offset,
                    prompt_logprob_targets=lp_targets or None,
                )
            )
            if samples:
                req.num_pending += 1
                req.last_future = fi
        wb = WorkerBatch(
            mode=mode,
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=out_loc,
            req_pool_indices=[r.req_pool_idx for r in reqs],  # type: ignore[misc]
            seq_lens=seq_lens,
            prefix_lens=prefix_lens,
            sampling=sampling,
            future_indices=future_indices,
            samples=list(samples_token),
            slot_writes=slot_writes,
            step_id=step_id,
        )
        return ScheduleBatch(
            mode=mode, reqs=reqs, samples_token=samples_token, worker_batch=wb, num_prefill_reqs=num_prefill_reqs
        )
