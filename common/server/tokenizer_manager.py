"""The frontend's request table and its link to the engine.

TokenizerManager owns rid -> ReqState for every request between `start` and
`release`, the FrontendChannel, and three background tasks:

    _recv_loop:     engine replies -> the owning request's queue (TokenOut) or a
                    stats waiter (StatsResp); every StatsResp refreshes the last
                    known engine stats and transfer health (`engine_problem`)
    _watchdog_loop: engine process gone, or a step older than --watchdog-timeout
                    on the step clock (liveness.py) -> every in-flight request
                    gets an error, new requests get 503, /health turns 503; a hung
                    engine also sets `fatal` and the launcher ends the instance
    _refresh_loop:  asks the engine for stats every STATS_REFRESH_S (answered
                    between steps), so /health never waits on the engine; every stats
                    caller shares one StatsReq in flight (engine_stats.py)

Bounds: at most --max-running-requests + --max-queued-requests requests in the table
(beyond: 503 with Retry-After at once; every request reaches the engine through here, so
this also bounds the scheduler's waiting queue, decode's prealloc and transfer queues);
a streaming request whose client stopped reading is aborted and its connection cut once
--max-stream-backlog outputs wait for it. Long prompts are tokenized in a thread.

A request is released exactly once: when its stream ends, fails, times out, or
its consumer goes away. Releasing a request the engine has not finished sends
AbortReq, so a client disconnect or a stop-string match frees the engine's slot.
Used from one event loop only.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from common.server.detokenizer import RequestDetokenizer
from common.server.engine_stats import EngineStats, StatsUnavailable
from common.server.input_processor import InputProcessor
from common.server.io_struct import (
    AbortReq,
    BatchTokenOut,
    FinishReason,
    GenerateReq,
    StatsReq,
    StatsResp,
    TokenOut,
)
from common.server.ipc import READY_SEQ, FrontendChannel, IpcSendTimeout
from common.server.liveness import IDLE_SNAPSHOT, StepClock, StepSnapshot, hung_reason
from common.server.metrics import FrontendMetrics
from common.server.protocol import ApiError, GenerateRequestBody, bad_request
from common.server.req_state import Chunk, ReqState, merge_chunks
from common.server.server_args import ServerArgs
from common.timeouts import wait_within

logger = logging.getLogger(__name__)

WATCHDOG_PERIOD_S = 0.25
STATS_REFRESH_S = 1.0
SEND_TIMEOUT_S = 5.0
OFFLOAD_CHARS = 8192  # text prompts longer than this are tokenized off the event loop
FULL_RETRY_AFTER_S = 1

DeadReason = Callable[[], "str | None"]  # None while the engine process lives


class TokenizerManager:
    def __init__(
        self,
        args: ServerArgs,
        processor: InputProcessor,
        channel: FrontendChannel,
        metrics: FrontendMetrics,
        engine_dead_reason: DeadReason,
        step_clock: StepClock | None = None,
    ) -> None:
        self.args = args
        self.processor = processor
        tokenizer = processor.tokenizer
        # return_text_in_logprobs: one decode per distinct token, not per entry (prompt x top-k entries)
        self._token_text = functools.lru_cache(maxsize=1 << 16)(lambda t: tokenizer.decode([t]))
        self.channel = channel
        self.metrics = metrics
        self._dead_reason_fn = engine_dead_reason
        self.step_clock = step_clock
        self.engine_dead: str | None = None
        self.engine_hung: str | None = None  # set once by the watchdog; the instance then ends
        self.fatal = asyncio.Event()  # the instance must end (engine_hung says why)
        self.engine_problem: str | None = None  # the engine answers but cannot serve (StatsResp.unhealthy)
        self._states: dict[str, ReqState] = {}
        self.engine_stats = EngineStats(self._send_stats_req, lambda: self.step_snapshot().steps)
        self._tasks: list[asyncio.Task[None]] = []
        self.max_in_flight = args.max_running_requests + args.max_queued_requests
        self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self._tokenizing = 0  # requests waiting for the tokenizer thread count against the bound too

    # Lifecycle

    def start_background(self) -> None:
        self._tasks = [
            asyncio.create_task(self._recv_loop(), name="engine-recv"),
            asyncio.create_task(self._watchdog_loop(), name="engine-watchdog"),
            asyncio.create_task(self._refresh_loop(), name="engine-stats-refresh"),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
        self.channel.close()

    @property
    def num_in_flight(self) -> int:
        return len(self._states)

    # Requests

    async def start(self, body: GenerateRequestBody, rid: str) -> ReqState:
        """Validate, register and send one request; ApiError(4xx/503) if it cannot start."""
        self._check_engine()
        held = len(self._states) + self._tokenizing
        if held >= self.max_in_flight:
            self.metrics.rejected_full.inc()
            raise ApiError(503, f"the instance is full ({held} requests in flight: "
                                f"--max-running-requests + --max-queued-requests); retry later",
                           "unavailable", retry_after=FULL_RETRY_AFTER_S)
        if rid in self._states:
            raise bad_request(f"a request with rid {rid!r} is already in flight")
        req = await self._process(body, rid)
        if rid in self._states:  # taken while the prompt was tokenized in a thread
            raise bad_request(f"a request with rid {rid!r} is already in flight")
        detok = None
        if not self.args.is_prefill:
            params = req.sampling_params
            detok = RequestDetokenizer(
                self.processor.tokenizer,
                req.input_ids,
                stops=params.stop,
                skip_special_tokens=params.skip_special_tokens,
                keep_stop=params.no_stop_trim,
            )
        incremental = self.args.incremental_streaming_output
        if body.incremental_stream is not None:
            incremental = body.incremental_stream
        token_text = self._token_text if body.return_text_in_logprobs else None
        state = ReqState(req=req, detok=detok, incremental=incremental, token_text=token_text)
        self._states[rid] = state
        self.metrics.in_flight.inc()
        self.engine_stats.activity += 1
        try:
            await self.channel.send(req, timeout_s=SEND_TIMEOUT_S)
        except IpcSendTimeout as e:
            state.engine_done = True
            self.release(state)
            raise ApiError(503, f"the engine is not taking requests: {e}") from None
        self.metrics.prompt_tokens.inc(len(req.input_ids))
        return state

    async def _process(self, body: GenerateRequestBody, rid: str) -> GenerateReq:
        if body.text is None or len(body.text) <= OFFLOAD_CHARS:
            return self.processor.process(body, rid)
        self.processor.check_text_len(body.text)
        loop = asyncio.get_running_loop()
        self._tokenizing += 1
        try:
            return await loop.run_in_executor(self._tokenize_pool, self.processor.process, body, rid)
        finally:
            self._tokenizing -= 1

    def _cut_off(self, state: ReqState) -> None:
        """The client has not read its stream while max_stream_backlog outputs piled up."""
        logger.warning("rid=%s: the client is not reading its stream (%d outputs waiting); aborting it",
                       state.rid, state.queue.qsize())
        self.metrics.stream_cut_off.inc()
        state.finished = True
        self.release(state, "the client is not reading its stream")
        state.cut_off.cut()

    async def stream(self, state: ReqState) -> AsyncIterator[Chunk]:
        """The request's chunks until it finishes; raises ApiError on engine error or timeout."""
        try:
            while not state.finished:
                item = await self._next_item(state)
                if isinstance(item, ApiError):
                    state.finished = True
                    raise item
                chunk = state.apply(item)
                self._observe(state, chunk)
                yield chunk
        finally:
            self.release(state)

    async def collect(self, state: ReqState) -> Chunk:
        return merge_chunks([chunk async for chunk in self.stream(state)])

    def release(self, state: ReqState, reason: str = "client went away") -> None:
        """Forget the request (idempotent); tell the engine to abort it if still running there."""
        if state.released:
            return
        state.released = True
        self._states.pop(state.rid, None)
        self.metrics.in_flight.dec()
        if not state.engine_done and self.engine_dead is None:
            state.engine_done = True
            if not self.channel.send_nowait(AbortReq(rid=state.rid, reason=reason)):
                logger.warning("could not send AbortReq for %s: engine not taking messages", state.rid)

    def abort(self, rid: str, message: str = "aborted by request") -> bool:
        """Finish `rid` now with finish_reason abort; False if no such request is in flight."""
        state = self._states.get(rid)
        if state is None or state.finished:
            return False
        if not state.engine_done:
            state.engine_done = True
            self.channel.send_nowait(AbortReq(rid=rid, reason=message))
        state.queue.put_nowait(
            TokenOut(
                rid=rid,
                new_token_ids=[],
                finish_reason=FinishReason(type="abort", message=message),
                prompt_tokens=len(state.req.input_ids),
                completion_tokens=state.completion_tokens,
                cached_tokens=0,
            )
        )
        return True

    async def _next_item(self, state: ReqState) -> TokenOut | ApiError:
        timeout = self.args.request_timeout
        if timeout is None:
            return await state.queue.get()
        remaining = state.created_at + timeout - time.monotonic()
        try:
            return await wait_within(state.queue.get(), max(remaining, 0.0))
        except asyncio.TimeoutError:
            state.finished = True
            raise ApiError(504, f"request {state.rid} timed out after {timeout}s", "timeout") from None

    def _observe(self, state: ReqState, chunk: Chunk) -> None:
        now = time.monotonic()
        n = len(chunk.output_ids)
        if n:
            if state.last_token_at is None:
                state.first_token_latency = now - state.created_at
                self.metrics.ttft.observe(state.first_token_latency)
            else:
                gap = (now - state.last_token_at) / n
                for _ in range(n):
                    self.metrics.itl.observe(gap)
            state.last_token_at = now
            self.metrics.generation_tokens.inc(n)
        if chunk.finish_reason is not None:
            self.metrics.e2e.observe(now - state.created_at)
            self.metrics.finish_reasons.labels(reason=chunk.finish_reason["type"]).inc()

    # Engine health and stats

    def _check_engine(self) -> None:
        if self.engine_dead is not None:
            raise ApiError(503, f"the engine is not running: {self.engine_dead}")
        if self.engine_hung is not None:
            raise ApiError(503, f"the instance is shutting down: {self.engine_hung}")

    def step_snapshot(self) -> StepSnapshot:
        return self.step_clock.read() if self.step_clock is not None else IDLE_SNAPSHOT

    def health(self) -> StepSnapshot:
        """Liveness from the step clock and the last known engine answer; never waits on the engine.

        Raises ApiError(503) when the engine is dead, hung, or reported a problem
        (StatsResp.unhealthy, e.g. its KV transfer is down); else returns the clock."""
        self._check_engine()
        snap = self.step_snapshot()
        reason = hung_reason(snap, time.monotonic(), self.args.watchdog_timeout)
        if reason is not None:  # the watchdog acts within WATCHDOG_PERIOD_S; say so meanwhile
            raise ApiError(503, reason)
        if self.engine_problem is not None:
            raise ApiError(503, self.engine_problem)
        return snap

    def _send_stats_req(self, seq: int) -> bool:
        self.metrics.stats_requests.inc()
        return self.channel.send_nowait(StatsReq(seq=seq))

    async def get_stats(self, timeout_s: float = 2.0, max_age_s: float = 0.0) -> dict[str, float]:
        """The engine's stats, asked for no earlier than this call (one StatsReq in flight, shared:
        common/server/engine_stats.py); with max_age_s the last answer while still true.
        ApiError(503) if the engine does not answer within timeout_s."""
        self._check_engine()
        try:
            stats = await self.engine_stats.fetch(timeout_s, max_age_s)
        except StatsUnavailable as e:
            self.metrics.engine.up = False
            raise ApiError(503, str(e)) from None
        self.metrics.engine.up = True
        return stats

    async def _recv_loop(self) -> None:
        while True:
            reply = await self.channel.recv()
            if isinstance(reply, BatchTokenOut):
                self.engine_stats.activity += 1
                for out in reply.items:
                    state = self._states.get(out.rid)
                    if state is not None and not state.finished:
                        state.queue.put_nowait(out)
                        if state.queue.qsize() > self.args.max_stream_backlog:
                            self._cut_off(state)
            elif isinstance(reply, StatsResp) and reply.seq != READY_SEQ:
                self.engine_problem = reply.unhealthy
                self.metrics.engine.up = True
                self.metrics.engine.stats = reply.stats
                self.engine_stats.answered(reply.seq, reply.stats)

    async def _refresh_loop(self) -> None:
        while self.engine_dead is None and self.engine_hung is None:
            self.engine_stats.refresh()  # one probe at a time: a long step answers it late
            await asyncio.sleep(STATS_REFRESH_S)

    async def _watchdog_loop(self) -> None:
        while self.engine_dead is None:
            reason = self._dead_reason_fn()
            if reason is not None:
                self._on_engine_dead(reason)
                return
            hung = hung_reason(self.step_snapshot(), time.monotonic(), self.args.watchdog_timeout)
            if hung is not None:
                self._on_engine_hung(hung)
                return
            await asyncio.sleep(WATCHDOG_PERIOD_S)

    def _on_engine_hung(self, reason: str) -> None:
        logger.error(
            "watchdog: %s; failing %d in-flight request(s) and ending this instance", reason, len(self._states)
        )
        self.engine_hung = reason
        self.metrics.engine.up = False
        self._fail_all(ApiError(503, reason, "engine_hung"), reason)
        self.fatal.set()

    def _on_engine_dead(self, reason: str) -> None:
        logger.error("engine process died (%s); failing %d in-flight request(s)", reason, len(self._states))
        self.engine_dead = reason
        self.metrics.engine.up = False
        self._fail_all(ApiError(500, f"the engine process died: {reason}", "engine_died"), reason)

    def _fail_all(self, error: ApiError, reason: str) -> None:
        for state in list(self._states.values()):
            state.engine_done = True
            state.queue.put_nowait(ApiError(error.status, error.message, error.err_type))
        self.engine_stats.fail(f"the engine is not running: {reason}")
