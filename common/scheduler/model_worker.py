"""The real model worker: WorkerBatch -> launch (forward, sample, async token copy) -> collect.

Runs on the executor's thread. It is the only code that touches device state
(KV tensors through the runner, the req_to_token table, the future token map,
the sampler's penalty state), and it does so strictly in step order.
"""

from __future__ import annotations

import time

import torch

from common.model.forward_batch import ForwardBatch
from common.model.model_runner import ModelRunner
from common.model.sampler import Sampler, SamplingBatchInfo
from common.sampling_params import SamplingParams
from common.scheduler import step_fault
from common.scheduler.executor import LaunchedStep, PromptLogprobs, SamplingRow, StepResult, WorkerBatch
from common.scheduler.prompt_logprobs import chunk_rows_for, prompt_logprobs


class TorchModelWorker:
    def __init__(self, runner: ModelRunner, sampler: Sampler, *, future_capacity: int) -> None:
        self.runner = runner
        self.sampler = sampler
        self.device = runner.device
        self.streams = runner.streams
        self.req_to_token = runner.req_to_token
        self.future_tokens = torch.zeros(future_capacity, dtype=torch.int64, device=self.device)
        self._info: SamplingBatchInfo | None = None
        self._info_key: tuple[list[SamplingParams], list[int], list[bool], list[int]] | None = None
        self._logprob_rows = chunk_rows_for(runner.vocab_size)  # prompt logprob positions per logits chunk

    @property
    def future_capacity(self) -> int:
        return int(self.future_tokens.shape[0])

    def on_thread_start(self) -> None:
        """The overlap loop's worker thread: its device and its own stream."""
        self.streams.enter_worker()

    def _apply_slot_writes(self, batch: WorkerBatch) -> None:
        if not batch.slot_writes:
            return
        rows: list[int] = []
        cols: list[int] = []
        vals: list[int] = []
        for w in batch.slot_writes:
            rows.extend([w.row] * len(w.slots))
            cols.extend(range(w.start, w.start + len(w.slots)))
            vals.extend(w.slots)
        r, c, v = self.streams.stage([rows, cols, vals], torch.int64)
        self.req_to_token[r, c] = v.to(self.req_to_token.dtype)

    def _forward_batch(self, b: WorkerBatch) -> ForwardBatch:
        fb = ForwardBatch.build(
            b.mode, b.input_ids, b.positions, b.out_cache_loc, b.req_pool_indices, b.seq_lens, b.prefix_lens,
            device=self.device, streams=self.streams,
        )
        ids = fb.input_ids
        if min(b.input_ids) < 0:  # FutureMap placeholders, resolved on the device
            pending = ids < 0
            fb.input_ids = torch.where(pending, self.future_tokens[(-ids - 1).clamp(min=0)], ids)
        return fb

    def run(self, batch: WorkerBatch) -> StepResult:
        """One step, launched and collected at once (the normal loop, TP followers)."""
        return self.collect(self.launch(batch))

    @torch.inference_mode()
    def launch(self, batch: WorkerBatch) -> LaunchedStep:
        """Queue the step's device work: inputs, forward, sampling into device tensors, the
        future-map store, and the async copy of the sampled tokens to host memory. Never waits
        for the device (a step whose prompt logprobs are asked for reads them back here)."""
        start = time.perf_counter()
        step_fault.before_forward()  # test-only: --engine-fault-spec makes this forward slow or hang
        self.streams.worker_waits_for_scheduler()
        self._apply_slot_writes(batch)
        fb = self._forward_batch(batch)
        for s in batch.sampling:
            if s.reset_prompt is not None:
                self.sampler.reset_row(s.row, s.reset_prompt, s.reset_outputs or [])
        prompt_logprobs = None
        if any(s.prompt_logprob_targets for s in batch.sampling):
            # Only steps with a request asking for prompt logprobs pay for every position's hidden state.
            hidden = self.runner.forward_hidden(fb, all_tokens=True)
            prompt_logprobs = self._prompt_logprobs(hidden, batch)
            ends = self.streams.stage_one([e - 1 for e in batch.extend_lens_cumsum()])
            logits = self.runner.compute_logits(hidden[ends])
        else:
            logits = self.runner.forward(fb)
        done = self.streams.record()  # the step's KV is written once this completes
        n = len(batch.sampling)
        # Only requests whose token is kept are sampled: a non-final prompt chunk must not
        # advance its row's seed step or penalty counts.
        keep = [i for i, s in enumerate(batch.samples) if s] if batch.samples else list(range(n))
        step = LaunchedStep(batch=batch, keep=keep, start=start, done=done, prompt_logprobs=prompt_logprobs)
        if not keep:  # nothing to stream (non-final prompt chunks): no host sync at all
            return step
        rows = [batch.sampling[i] for i in keep]
        everyone = len(keep) == n
        index, future = self.streams.stage([keep, [batch.future_indices[i] for i in keep]], torch.int64)
        info = self._sampling_info(rows)
        kept_logits = logits if everyone else logits[index]
        if batch.grammar_mask is not None:
            batch.grammar_mask.apply(kept_logits)  # waits for the scheduler's fill (overlap loop)
        out = self.sampler.sample(kept_logits, info)
        self.runner.tp.broadcast_(out.next_token_ids)  # TP: every rank feeds rank 0's tokens back
        self.future_tokens[future] = out.next_token_ids
        wanted = [out.next_token_ids]
        if out.logprobs is not None:
            wanted.append(out.logprobs)
        if out.top_logprobs is not None:
            wanted += [out.top_logprobs.values, out.top_logprobs.token_ids]
        step.copy = self.streams.start_fetch(wanted)
        step.has_logprobs = out.logprobs is not None
        step.has_top = out.top_logprobs is not None
        step.launch_seconds = time.perf_counter() - start
        return step

    def _sampling_info(self, rows: list[SamplingRow]) -> SamplingBatchInfo:
        """The batch's sampling tensors; the previous step's when its rows and params are the same
        (steady decode): no staging, no host -> device copies. The sampler only reads them."""
        key = ([s.params for s in rows], [s.row for s in rows], [s.return_logprob for s in rows],
               [s.top_logprobs_num for s in rows])
        if self._info_key == key and self._info is not None:
            return self._info
        params, row_ids, want_logprob, nums = key
        self._info = SamplingBatchInfo.from_params(
            params, row_ids, vocab_size=self.runner.vocab_size, device=self.device, return_logprob=any(want_logprob),
            top_logprobs_nums=nums, streams=self.streams,
        )
        self._info_key = key
        return self._info

    def collect(self, step: LaunchedStep) -> StepResult:
        """Wait for a launched step's tokens (its one host sync) and build its StepResult."""
        batch, keep = step.batch, step.keep
        n = len(batch.sampling)
        if step.copy is None:
            return StepResult(next_token_ids=[0] * n, forward_seconds=time.perf_counter() - step.start,
                              prompt_logprobs=step.prompt_logprobs, done=step.done)
        fetched = iter(step.copy.wait())
        kept_ids: list[int] = next(fetched)
        next_ids = [0] * n
        for i, t in zip(keep, kept_ids, strict=True):
            next_ids[i] = t
        logprobs: list[float] | None = None
        top: list[list[tuple[int, float]]] | None = None
        if step.has_logprobs:
            logprobs = [0.0] * n
            for i, lp in zip(keep, next(fetched), strict=True):
                logprobs[i] = lp
        if step.has_top:
            values, ids = next(fetched), next(fetched)
            top = [[] for _ in batch.sampling]
            for j, i in enumerate(keep):
                k = batch.sampling[i].top_logprobs_num
                top[i] = list(zip(ids[j][:k], values[j][:k], strict=True))
        return StepResult(
            next_token_ids=next_ids,
            logprobs=logprobs,
            top_logprobs=top,
            forward_seconds=time.perf_counter() - step.start,
            prompt_logprobs=step.prompt_logprobs,
            done=step.done,
        )

    def _prompt_logprobs(self, hidden: torch.Tensor, batch: WorkerBatch) -> list[PromptLogprobs | None]:
        """log_softmax of the raw logits at each requested prompt position, gathered at its target
        (in chunks of at most self._logprob_rows positions: common/scheduler/prompt_logprobs.py)."""
        out: list[PromptLogprobs | None] = [None] * len(batch.sampling)
        begin = 0
        for i, (s, end) in enumerate(zip(batch.sampling, batch.extend_lens_cumsum(), strict=True)):
            targets = s.prompt_logprob_targets
            if targets:
                at = begin + s.prompt_logprob_offset
                out[i] = prompt_logprobs(self.runner.compute_logits, hidden[at : at + len(targets)], targets,
                                         s.top_logprobs_num, self._logprob_rows)
            begin = end
        return out
