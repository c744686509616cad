"""The scheduler: continuous batching with chunked prefill, radix reuse, retraction, overlap.

One iteration (`step`):

    batch N+1 = get_next_batch()        prefill first (PrefillAdder), else decode
    submit(batch N+1) to the executor    (overlap: before batch N's result is processed)
    process_result(batch N)              append tokens, finish, stream, free/cache KV

Normal mode processes each batch's result right after submitting it. Overlap is
skipped for two consecutive prefill batches (the first one's token is streamed
before the second prefill runs: better TTFT). Roles (prefill/decode in PD mode)
subclass it and override the role methods at the bottom, each of which this class calls;
they are built by common/scheduler/role.py's RoleSpec.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from common.grammar.backend import GrammarBackend
from common.grammar.mask import StepGrammarMask
from common.grammar.spec import grammar_of
from common.model.device_streams import StepEvent
from common.model.forward_batch import ForwardMode
from common.scheduler.config import SchedulerConfig
from common.scheduler.executor import Executor, FutureIndexAllocator, PromptLogprobs, StepHandle, StepResult
from common.scheduler.grammar_queue import GrammarQueue
from common.scheduler.kv_manager import ReqKVManager
from common.scheduler.messages import FinishReason, TokenOut
from common.scheduler.new_token_ratio import NewTokenRatioTracker
from common.scheduler.policy import SchedulePolicy
from common.scheduler.prefill_adder import AddResult, PrefillAdder
from common.scheduler.req import Req, ReqState
from common.scheduler.schedule_batch import BatchBuilder, ScheduleBatch

logger = logging.getLogger(__name__)

OutputSink = Callable[[list[TokenOut]], None]


class PageFate(enum.Enum):
    """What a finishing request's KV pages become."""

    CACHE = "cache"  # whole computed pages join the radix cache, the rest is freed
    FREE = "free"  # all freed
    KEEP = "keep"  # untouched: the role releases them later (e.g. after a drain ack)


class RequestRejected(ValueError):
    """A request the engine cannot serve (message is safe for the client); 400 unless the
    instance itself cannot serve it right now (503: a router tries another)."""

    def __init__(self, message: str, status_code: int = 400) -> None:
        super().__init__(message)
        self.status_code = status_code


@dataclass
class InFlight:
    batch: ScheduleBatch
    handle: StepHandle


class Scheduler:
    def __init__(
        self, cfg: SchedulerConfig, executor: Executor, kv: ReqKVManager, *, future_capacity: int, output: OutputSink
    ) -> None:
        self.cfg = cfg
        self.executor = executor
        self.kv = kv
        self.output = output
        self.policy = SchedulePolicy(cfg.schedule_policy, lpm_fcfs_fallback=cfg.lpm_fcfs_fallback_queue_len, seed=cfg.random_seed)
        self.ratio = NewTokenRatioTracker(
            init=cfg.init_new_token_ratio * cfg.schedule_conservativeness,
            min_factor=cfg.min_new_token_ratio_factor,
            decay_steps=cfg.new_token_ratio_decay_steps,
            retract_steps=cfg.retract_decode_steps,
        )
        self.futures = FutureIndexAllocator(future_capacity)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.reqs: dict[str, Req] = {}
        self.in_flight: InFlight | None = None
        self.last_mode: ForwardMode | None = None
        self.step_id = 0
        self._outbox: list[TokenOut] = []
        self._idle_checked = False
        self.num_retractions = 0
        self.num_decode_steps = 0
        self.num_prefill_steps = 0
        self.num_prompt_tokens = 0
        self.num_cached_prompt_tokens = 0
        # CPU time the loop spends outside waiting for the worker (bench: sched_ms_per_step)
        self.busy_seconds = 0.0
        self.step_seconds = 0.0  # wall time of steps, forwards included (the measured prefill rate's clock)
        self.wait_seconds = 0.0
        self.num_steps = 0
        # structured output (attach_grammar_backend): compiles waited for, masks to fill after a step
        self.grammar_queue: GrammarQueue | None = None
        self._unfilled_masks: list[StepGrammarMask] = []
        self.num_grammar_rejections = 0
        self.num_grammar_terminations = 0

    def attach_grammar_backend(self, backend: GrammarBackend) -> None:
        """--grammar-backend xgrammar: constrained requests are served (without one they get 400)."""
        self.grammar_queue = GrammarQueue(backend)

    # ---- requests in ------------------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        self.validate_request(req)
        self.reqs[req.rid] = req
        self._idle_checked = False
        if grammar_of(req.sampling_params) is not None and req.grammar is None:
            assert self.grammar_queue is not None
            self.grammar_queue.add(req)  # enqueued once compiled (poll_grammars)
            self.poll_grammars()
            return
        self.enqueue(req)

    def poll_grammars(self) -> None:
        """Enqueue the requests whose grammar compiled; fail those whose compile failed."""
        if not self.grammar_queue:
            return
        for done in self.grammar_queue.pop_done():
            if done.error is not None:
                self._finish(done.req, FinishReason("abort", message=done.error, status_code=done.status_code,
                                                    err_type="invalid_grammar" if done.status_code == 400 else None))
            else:
                self.enqueue(done.req)

    def enqueue(self, req: Req) -> None:
        """Where a validated request starts (roles: bootstrap / prealloc queues)."""
        self.waiting.append(req)

    def validate_request(self, req: Req) -> None:
        if req.rid in self.reqs:
            raise RequestRejected(f"duplicate request id {req.rid!r}")
        n = len(req.origin_input_ids)
        if n == 0:
            raise RequestRejected("the prompt is empty")
        if n >= self.cfg.context_length:
            raise RequestRejected(f"the prompt has {n} tokens; the context length is {self.cfg.context_length}")
        capacity = self.kv.allocator.num_usable * self.kv.page_size
        if n + 1 > capacity:
            raise RequestRejected(f"the prompt needs {n + 1} KV slots; this instance holds {capacity}")
        if grammar_of(req.sampling_params) is not None and self.grammar_queue is None:
            raise RequestRejected("structured output (json_schema / regex / ebnf) is off on this instance "
                                  "(--grammar-backend none)")

    def abort(self, rid: str, reason: str = "aborted", status_code: int = 499) -> bool:
        req = self.reqs.get(rid)
        if req is None or req.finished:
            return False
        self._finish(req, FinishReason("abort", message=reason, status_code=status_code))
        return True

    @property
    def has_runnable_work(self) -> bool:
        """Something a step can compute or resolve now."""
        return bool(self.waiting or self.running or self.chunked or self.in_flight)

    @property
    def has_work(self) -> bool:
        """Anything not finished (roles add requests waiting on transfers)."""
        return self.has_runnable_work or bool(self.grammar_queue)

    # ---- the loop ---------------------------------------------------------------------------
    def step(self) -> None:
        start = time.perf_counter()
        wait_before = self.wait_seconds
        self._step()
        self.num_steps += 1
        self.busy_seconds += time.perf_counter() - start - (self.wait_seconds - wait_before)
        self.step_seconds += time.perf_counter() - start

    def _step(self) -> None:
        batch = self.get_next_batch()
        if batch is None:
            self._resolve_in_flight()
        elif not self.cfg.enable_overlap:
            self._launch(batch)
            self._resolve_in_flight()
        else:
            if batch.is_extend and self.in_flight is not None and self.in_flight.batch.is_extend:
                self._resolve_in_flight()
            mask = batch.worker_batch.grammar_mask
            if mask is not None and not mask.ready and not self.executor.worker_thread:
                # One thread launches and samples: constrained rows need the step in flight's
                # tokens accepted before this launch (a worker thread waits for the fill instead).
                self._resolve_in_flight()
            previous = self.in_flight
            self.in_flight = None
            self._launch(batch)
            if previous is not None:
                self._process(previous)
        self._flush_outbox()
        if self.in_flight is None:
            self.kv.free_deferred()
        if not self.has_work:
            self.on_idle()

    def run_until_idle(self, max_steps: int = 10_000_000) -> None:
        for _ in range(max_steps):
            if not self.has_work:
                return
            self.step()
        raise RuntimeError("scheduler did not go idle")

    def _launch(self, batch: ScheduleBatch) -> None:
        self.in_flight = InFlight(batch, self.executor.submit(batch.worker_batch))
        self.last_mode = batch.mode

    def _resolve_in_flight(self) -> None:
        if self.in_flight is not None:
            inflight, self.in_flight = self.in_flight, None
            self._process(inflight)

    def on_idle(self) -> None:
        self.ratio.on_idle()
        if not self._idle_checked:
            self.kv.check_integrity()
            self._idle_checked = True

    # ---- scheduling -------------------------------------------------------------------------
    def get_next_batch(self) -> ScheduleBatch | None:
        self.poll_grammars()
        self.running = [r for r in self.running if not r.finished]
        batch = self._get_prefill_batch()
        if batch is not None:
            return batch
        return self._get_decode_batch()

    def _get_prefill_batch(self) -> ScheduleBatch | None:
        if not self.waiting and self.chunked is None:
            return None
        max_new = self.cfg.max_running_requests - len(self.running) - (1 if self.chunked else 0)
        adder = PrefillAdder(self.kv, self.running, self.cfg, new_token_ratio=self.ratio.value, max_new_reqs=max_new)
        if self.chunked is not None:
            chunked, self.chunked = self.chunked, None
            adder.add_chunked(chunked)
        if adder.new_chunked is None:
            ordered = self.policy.order(self.waiting, self._prefix_len)
            for req in ordered:
                slots, node = self.kv.match_prefix(_match_key(req))
                if adder.add_one(req, slots, node) is not AddResult.CONTINUE:
                    break
        if not adder.can_run:
            return None
        admitted = set(adder.can_run)
        self.waiting = [r for r in self.waiting if r not in admitted]
        reqs = adder.can_run
        samples = []
        for req in reqs:
            last_chunk = req.kv_len == len(req.fill_ids)
            samples.append(last_chunk)
            if last_chunk:
                self.on_prompt_scheduled(req)
            else:
                req.state = ReqState.CHUNKED
                self.chunked = req
            self.num_prompt_tokens += req.extend_len
            if req.retractions == 0 and req.kv_len - req.extend_len == req.tree_len:
                self.num_cached_prompt_tokens += req.tree_len
        self.num_prefill_steps += 1
        lens = [r.extend_len for r in reqs]
        num_prefill = len(reqs)
        mode = ForwardMode.EXTEND
        if self.cfg.enable_mixed_chunk:
            decoding = self._mixed_decode_reqs(set(reqs))
            if decoding:
                mode = ForwardMode.MIXED
                reqs = reqs + decoding
                lens += [1] * len(decoding)
                samples += [True] * len(decoding)
        return self._build(mode, reqs, lens, samples, num_prefill_reqs=num_prefill)

    def _mixed_decode_reqs(self, exclude: set[Req]) -> list[Req]:
        """--enable-mixed-chunk: running requests ride along the prefill chunk with one token
        each, when their next slot is free without retracting anyone."""
        reqs = [r for r in self._decodable() if r not in exclude and r.num_pending <= 1]
        if not reqs or not self._decode_fits(reqs):
            return []
        for req in reqs:
            slots = self.kv.alloc_tokens(req, 1)
            assert slots is not None, "mixed decode allocation failed after check"
        return reqs

    def _prefix_len(self, ids: list[int]) -> int:
        return len(self.kv.radix.match_prefix(ids).slots)

    def _decodable(self) -> list[Req]:
        return [r for r in self.running if not r.finished and r.remaining_new_tokens > 0 and r.kv_len > 0]

    def _get_decode_batch(self) -> ScheduleBatch | None:
        reqs = self._decodable()
        if not reqs:
            return None
        if not self._decode_fits(reqs):
            # Retraction needs every token known: finish the step in flight first.
            self._resolve_in_flight()
            reqs = self._decodable()
            if not reqs:
                return None
            if not self._decode_fits(reqs):
                self.retract(reqs)
                reqs = self._decodable()
                if not reqs:  # the last request could not fit and was failed
                    return None
        for req in reqs:
            slots = self.kv.alloc_tokens(req, 1)
            assert slots is not None, "decode allocation failed after check_decode_mem"
        self.ratio.on_decode_step()
        self.num_decode_steps += 1
        return self._build(ForwardMode.DECODE, reqs, [1] * len(reqs), [True] * len(reqs))

    def _decode_fits(self, reqs: list[Req], steps: int = 1) -> bool:
        if self.in_flight is None:
            self.kv.free_deferred()
        need = sum(self.kv.pages_needed(r.kv_len, steps) for r in reqs)
        return self.kv.ensure_free_pages(need)

    def retract(self, reqs: list[Req]) -> list[Req]:
        """Retract until the kept requests fit for retract_decode_steps steps (keep >= 1)."""
        order = sorted(reqs, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
        kept = list(reqs)
        retracted: list[Req] = []
        while len(kept) > 1 and not self._decode_fits(kept, self.cfg.retract_decode_steps):
            victim = order.pop(0)
            kept.remove(victim)
            retracted.append(victim)
            self.on_retract(victim)
        if not self._decode_fits(kept):
            victim = kept.pop()
            if self.can_retract_last(victim):
                retracted.append(victim)
                self.on_retract(victim)
            else:  # even alone it cannot take one more token: fail it rather than hang
                self._finish(victim, FinishReason("abort", message="out of KV memory", status_code=503))
        if kept:  # with nobody kept the rule would give 0 and disable every reservation
            self.ratio.on_retract(
                [len(r.output_ids) for r in kept], [r.sampling_params.max_new_tokens for r in kept]
            )
        self.num_retractions += len(retracted)
        if retracted:
            logger.info("retracted %d requests (kept %d), new_token_ratio=%.3f", len(retracted), len(kept), self.ratio.value)
        return retracted

    def on_retract(self, req: Req) -> None:
        """Colocated: give the KV to the radix cache and re-prefill later."""
        assert req.num_pending == 0, f"retracting a request with tokens in flight: {req}"
        self.kv.release(req, keep_in_cache=True)
        self.running.remove(req)
        req.state = ReqState.RETRACTED
        req.retractions += 1
        self.waiting.insert(0, req)

    # ---- hooks for roles -----------------------------------------------------------------
    def can_retract_last(self, req: Req) -> bool:
        """The last running request cannot grow. Colocated: nothing else holds KV that will come
        back, so it fails. Roles whose other requests hold pages (decode) retract it instead."""
        return False

    def on_prompt_scheduled(self, req: Req) -> None:
        """The step computing req's last prompt chunk was scheduled; colocated: it decodes next."""
        req.state = ReqState.RUNNING
        self.running.append(req)

    def on_chunk_computed(self, req: Req, computed_len: int, done: StepEvent) -> None:
        """A non-final prompt chunk of req has been computed: KV of tokens [0, computed_len)
        is written once `done` completes (the step samples nothing, so the worker did not wait
        for it; req.kv_len may already include the next chunk, scheduled meanwhile)."""

    def on_prompt_computed(self, req: Req, done: StepEvent) -> bool:
        """req's whole prompt is computed (its KV written once `done` completes) and its first
        token appended. Return True when the role takes the request over (e.g. prefill sends
        it to decode); colocated: cache the prompt pages and keep decoding."""
        self.kv.cache_prefix(req)
        return False

    def _build(
        self, mode: ForwardMode, reqs: list[Req], lens: list[int], samples: list[bool], *, num_prefill_reqs: int = 0
    ) -> ScheduleBatch:
        self.step_id += 1
        futures = self.futures.take(len(reqs))
        batch = BatchBuilder.build(
            mode, reqs, lens, samples, futures, self.kv.take_pending_writes(), self.step_id, num_prefill_reqs
        )
        batch.worker_batch.grammar_mask = self._grammar_mask(reqs, samples)
        return batch

    def _grammar_mask(self, reqs: list[Req], samples: list[bool]) -> StepGrammarMask | None:
        """The step's mask over its constrained sampled rows; filled now when every such row's
        tokens are known, else right after the step in flight is processed."""
        if self.grammar_queue is None:
            return None
        rows, grammars, settled = [], [], True
        for k, req in enumerate(r for r, s in zip(reqs, samples, strict=True) if s):
            if req.grammar is not None:
                rows.append(k)
                grammars.append(req.grammar)
                settled = settled and req.num_pending <= 1  # only this step's token is outstanding
        if not rows:
            return None
        mask = StepGrammarMask(rows, grammars, self.grammar_queue.backend.vocab_size)
        if settled:
            mask.fill()
        else:
            self._unfilled_masks.append(mask)
        return mask

    def _fill_masks(self) -> None:
        masks, self._unfilled_masks = self._unfilled_masks, []
        for mask in masks:
            mask.fill()

    # ---- results ----------------------------------------------------------------------------
    def _process(self, inflight: InFlight) -> None:
        batch = inflight.batch
        wait_start = time.perf_counter()
        result: StepResult = inflight.handle.result()
        self.wait_seconds += time.perf_counter() - wait_start
        # Every page deferred so far was released while this step (or an older one) was the
        # newest in flight, and the step launched after it was built without those pages.
        self.kv.free_deferred()
        for i, (req, samples) in enumerate(zip(batch.reqs, batch.samples_token, strict=True)):
            if samples:
                req.num_pending -= 1
            if req.finished:
                continue
            prompt_logprobs = result.prompt_logprobs[i] if result.prompt_logprobs is not None else None
            if prompt_logprobs is not None:
                _add_prompt_logprobs(req, prompt_logprobs)
            if not samples:
                self.on_chunk_computed(req, batch.worker_batch.seq_lens[i], result.done)
                continue
            token = result.next_token_ids[i]
            if req.sampling_params.max_new_tokens == 0:  # prompt only (e.g. prompt logprobs): no token
                self._finish(req, FinishReason("length"))
                continue
            req.output_ids.append(token)
            if req.return_logprob and result.logprobs is not None:
                req.output_logprobs.append(result.logprobs[i])
                if result.top_logprobs is not None:
                    req.output_top_logprobs.append(result.top_logprobs[i])
            if req.grammar is not None and not self.accept_grammar_token(req, token):
                continue
            if batch.is_prompt(i) and self.on_prompt_computed(req, result.done):
                continue
            reason = self.finish_reason_after(req, token)
            if reason is not None:
                self._finish(req, reason)
            elif req.stream:
                self._emit(req)
        self._fill_masks()

    def accept_grammar_token(self, req: Req, token: int) -> bool:
        """Advance req's grammar by its newest token; a token the grammar rejects ends the request
        with an error (never silently: the output so far is sent with it)."""
        assert req.grammar is not None
        if req.grammar.accept(token):
            return True
        self.num_grammar_rejections += 1
        self._finish(req, FinishReason(
            "abort", status_code=500, err_type="grammar_rejected",
            message=f"token {token} at output position {len(req.output_ids) - 1} is not allowed by the request's "
                    f"{req.grammar.spec.kind}"))
        return False

    def finish_reason_after(self, req: Req, token: int) -> FinishReason | None:
        """check_finished, and "stop" once a grammar has accepted its end."""
        reason = req.check_finished(token)
        if reason is None and req.grammar is not None and req.grammar.is_terminated:
            self.num_grammar_terminations += 1
            reason = FinishReason("stop", matched_token=token)
        return reason

    def _finish(self, req: Req, reason: FinishReason) -> None:
        req.finish_reason = reason
        req.state = ReqState.FINISHED
        if self.grammar_queue is not None:
            self.grammar_queue.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if self.chunked is req:
            self.chunked = None
        fate = self.on_finish(req)
        if fate is not PageFate.KEEP:
            self.kv.release(req, keep_in_cache=fate is PageFate.CACHE)
        self.reqs.pop(req.rid, None)
        self._emit(req)

    def on_finish(self, req: Req) -> PageFate:
        """Hook for roles (e.g. abort a transfer); says what happens to req's KV pages."""
        return PageFate.CACHE

    def _emit(self, req: Req) -> None:
        new = req.output_ids[req.sent_len :]
        lp = req.output_logprobs[req.sent_len :] if req.return_logprob else None
        top = req.output_top_logprobs[req.sent_len :] if req.top_logprobs_num else None
        req.sent_len = len(req.output_ids)
        prompt_lp = prompt_top = None
        if req.logprob_start_len >= 0 and not req.input_logprobs_sent and not req.wants_prompt_logprobs:
            req.input_logprobs_sent = True
            prompt_lp = req.input_logprobs
            prompt_top = req.input_top_logprobs if req.top_logprobs_num else None
        self._outbox.append(
            TokenOut(
                rid=req.rid,
                new_token_ids=new,
                finish_reason=req.finish_reason,
                prompt_tokens=len(req.origin_input_ids),
                completion_tokens=len(req.output_ids),
                cached_tokens=req.cached_tokens,
                new_token_logprobs=lp,
                new_top_logprobs=top,
                input_logprobs=prompt_lp,
                input_top_logprobs=prompt_top,
            )
        )

    def _flush_outbox(self) -> None:
        if self._outbox:
            out, self._outbox = self._outbox, []
            self.output(out)

    def flush(self) -> None:
        """End of a loop iteration: send outputs produced outside a step (e.g. by transfer polls)
        and free deferred pages when no step is in flight (a request that finished without a
        step, e.g. on its first token in PD decode, would otherwise hold them until the next one)."""
        self.poll_grammars()
        if self.in_flight is None:
            self.kv.free_deferred()
        self._flush_outbox()

    # ---- observability ----------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        s = {
            "num_waiting_reqs": float(len(self.waiting)),
            "num_running_reqs": float(len([r for r in self.running if not r.finished])),
            "num_chunked_reqs": float(1 if self.chunked else 0),
            "new_token_ratio": self.ratio.value,
            "num_retractions_total": float(self.num_retractions),
            "num_decode_steps_total": float(self.num_decode_steps),
            "num_prefill_steps_total": float(self.num_prefill_steps),
            "prompt_tokens_total": float(self.num_prompt_tokens),
            # the router's load report (GET /get_load): queued prompt work and the measured rate
            "num_waiting_tokens": float(sum(len(r.origin_input_ids) for r in self.waiting)
                                        + (len(self.chunked.fill_ids) - self.chunked.kv_len if self.chunked else 0)),
            "step_seconds_total": self.step_seconds,
            "max_running_requests": float(self.cfg.max_running_requests),
            "cache_hit_rate": self.num_cached_prompt_tokens / max(1, self.num_prompt_tokens + self.num_cached_prompt_tokens),
        }
        s.update(self.kv.stats())
        if self.grammar_queue is not None:
            s.update(self.grammar_queue.backend.stats())
            s["num_grammar_queue_reqs"] = float(len(self.grammar_queue))
            s["grammar_rejections_total"] = float(self.num_grammar_rejections)
            s["grammar_terminations_total"] = float(self.num_grammar_terminations)
        return s


def _match_key(req: Req) -> list[int]:
    """The tokens a request may reuse from the prefix cache: all but the last, or for prompt
    logprobs only those before the first position whose logits are needed."""
    if req.wants_prompt_logprobs:
        return req.fill_ids[: max(req.logprob_start_len, 1)]
    return req.fill_ids


def _add_prompt_logprobs(req: Req, item: PromptLogprobs) -> None:
    logprobs, tops = item
    if req.logprob_start_len == 0 and not req.input_logprobs:
        req.input_logprobs.append(None)  # token 0 has no context
        if req.top_logprobs_num:
            req.input_top_logprobs.append([])
    req.input_logprobs.extend(logprobs)
    if tops is not None and req.top_logprobs_num:
        req.input_top_logprobs.extend(tops)
