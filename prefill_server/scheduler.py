"""Prefill role: compute prompts and push their KV pages to the decode instance.

    request ─> bootstrap queue ──(decode reserved pages: WaitingForInput)──> waiting queue
           ─> chunked prefill; after each chunk's forward its whole pages are sent;
              radix-cache hits go out as soon as the request is scheduled
           ─> last chunk: the rest (partial page included) + aux row (first token,
              cached tokens, room) ─> inflight queue ─> Success: pages join the radix
              cache, the client gets meta_info | Failed: pages freed, client gets the error

The request never decodes here. Pages stay owned by the request (no cache_prefix)
until its transfer ends, so no page a WRITE may still read is freed or swapped.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from common.disaggregation import transfer_failure, transfer_stats
from common.model.device_streams import READY, StepEvent
from common.model.forward_batch import ForwardMode
from common.scheduler.config import SchedulerConfig
from common.scheduler.executor import Executor
from common.scheduler.kv_manager import ReqKVManager
from common.scheduler.messages import FinishReason
from common.scheduler.req import Req, ReqState
from common.scheduler.schedule_batch import ScheduleBatch
from common.scheduler.scheduler import OutputSink, PageFate, Scheduler
from kv_transfer import AuxRow, KVManager, KVPoll, KVSender

logger = logging.getLogger(__name__)


@dataclass
class PendingPost:
    """Pages whose KV a step still in flight on the device writes: posted once `after` completes."""

    pages: list[int]
    is_last: bool
    aux: AuxRow | None
    after: StepEvent


@dataclass
class PrefillSend:
    """One request's transfer to decode, owned by the PrefillScheduler."""

    sender: KVSender
    pages_sent: int = 0  # pages of the prompt handed to the sender or queued for it
    first_send_at: float | None = None
    prompt_done_at: float | None = None
    pending: list[PendingPost] = field(default_factory=list)  # in order; posted by post_ready()

    def post_ready(self) -> None:
        """Hand the sender every queued post whose step has completed, in order (NIXL reads the
        pages when it posts: never before the forward that writes them is done)."""
        while self.pending and self.pending[0].after.query():
            post = self.pending.pop(0)
            if self.sender.poll() != KVPoll.Failed:
                self.sender.send(post.pages, is_last=post.is_last, aux=post.aux)
                if self.first_send_at is None:
                    self.first_send_at = time.monotonic()


class PrefillScheduler(Scheduler):
    def __init__(
        self, cfg: SchedulerConfig, executor: Executor, kv: ReqKVManager, *, future_capacity: int, output: OutputSink,
        transfer: KVManager,
    ) -> None:
        super().__init__(cfg, executor, kv, future_capacity=future_capacity, output=output)
        self.transfer = transfer
        self.sends: dict[Req, PrefillSend] = {}
        self.bootstrap_queue: list[Req] = []
        self.inflight: list[Req] = []
        self.num_transfer_failures = 0
        self.num_pages_skipped = 0  # prompt pages not sent: the decode held them in its prefix cache
        # Overlap of KV transfer with compute: for each successful request, the time from its
        # first send to Success (total) and from its last chunk's compute to Success (exposed).
        self.transfer_total_seconds = 0.0
        self.transfer_exposed_seconds = 0.0

    @property
    def has_work(self) -> bool:
        return self.has_runnable_work or bool(self.bootstrap_queue or self.inflight)

    # ---- intake -----------------------------------------------------------------------------
    def enqueue(self, req: Req) -> None:
        assert req.bootstrap is not None, f"prefill request without bootstrap info: {req}"
        self.sends[req] = PrefillSend(self.transfer.create_sender(req.rid, req.bootstrap.room))
        self.bootstrap_queue.append(req)

    def poll_transfers(self) -> None:
        """Each loop iteration: post pages whose step has completed, move ready requests on,
        fail broken ones."""
        for send in self.sends.values():
            send.post_ready()
        still: list[Req] = []
        for req in list(self.bootstrap_queue):
            sender = self.sends[req].sender
            state = sender.poll()
            if state == KVPoll.Failed:
                self._fail(req, sender)
            elif state >= KVPoll.WaitingForInput:
                expected = self._num_pages(len(req.origin_input_ids))
                reserved = (sender.num_dst_pages or 0) + sender.skip_pages
                if reserved != expected or sender.skip_pages >= expected:
                    sender.abort(f"decode reserved {sender.num_dst_pages} pages after {sender.skip_pages} it holds, "
                                 f"prefill needs {expected}")
                    self._fail(req, sender)
                else:
                    self.sends[req].pages_sent = sender.skip_pages  # decode holds those: never sent
                    self.waiting.append(req)
            else:
                still.append(req)
        self.bootstrap_queue = [r for r in still if not r.finished]
        for req in list(self.waiting) + ([self.chunked] if self.chunked else []):
            sender = self.sends[req].sender
            if sender.poll() == KVPoll.Failed:
                self._fail(req, sender)
        for req in list(self.inflight):
            send = self.sends[req]
            state = send.sender.poll()
            if state == KVPoll.Success:
                now = time.monotonic()
                self.transfer_total_seconds += now - (send.first_send_at or now)
                self.transfer_exposed_seconds += now - (send.prompt_done_at or now)
                skipped = send.sender.skip_pages
                self.num_pages_skipped += skipped
                logger.info("rid=%s room=%s KV sent: %d of %d prompt pages (decode held %d)", req.rid,
                            send.sender.room, send.pages_sent - skipped, send.pages_sent, skipped)
                self._finish(req, FinishReason("length"))  # on_finish takes it out of inflight
            elif state == KVPoll.Failed:
                self._fail(req, send.sender)

    # ---- sending ----------------------------------------------------------------------------
    def _num_pages(self, tokens: int) -> int:
        return -(-tokens // self.kv.page_size)

    def _send_pages(self, req: Req, upto_tokens: int, *, is_last: bool, after: StepEvent = READY) -> None:
        """Queue the prompt's pages up to `upto_tokens` for the sender, posted once `after` (the
        step writing their KV) completes."""
        send = self.sends[req]
        if send.sender.poll() == KVPoll.Failed:
            return
        ps = self.kv.page_size
        first = send.pages_sent
        last = self._num_pages(upto_tokens) if is_last else upto_tokens // ps
        if last <= first and not is_last:
            return
        pages = [req.kv_slots[i * ps] // ps for i in range(first, last)]
        aux = None
        if is_last:
            logprob = req.output_logprobs[0] if req.output_logprobs else None
            top = tuple(req.output_top_logprobs[0]) if req.output_top_logprobs else ()
            aux = AuxRow(first_token=req.output_ids[0], cached_tokens=req.cached_tokens, logprob=logprob,
                         top_logprobs=top)
        send.pending.append(PendingPost(pages, is_last, aux, after))
        send.pages_sent = last
        send.post_ready()

    def _build(
        self, mode: ForwardMode, reqs: list[Req], lens: list[int], samples: list[bool], *, num_prefill_reqs: int = 0
    ) -> ScheduleBatch:
        # Radix-cache hits are already in the pool: send them before the suffix is computed.
        for req in reqs:
            send = self.sends.get(req)
            if send is not None and send.first_send_at is None and req.tree_len > 0:
                self._send_pages(req, req.tree_len, is_last=False)
        return super()._build(mode, reqs, lens, samples, num_prefill_reqs=num_prefill_reqs)

    def on_prompt_scheduled(self, req: Req) -> None:
        req.state = ReqState.RUNNING  # computing its last chunk; never joins self.running

    def on_chunk_computed(self, req: Req, computed_len: int, done: StepEvent) -> None:
        self._send_pages(req, computed_len, is_last=False, after=done)

    def on_prompt_computed(self, req: Req, done: StepEvent) -> bool:
        send = self.sends[req]
        send.prompt_done_at = time.monotonic()
        self._send_pages(req, len(req.origin_input_ids), is_last=True, after=done)
        if send.sender.poll() == KVPoll.Failed:
            self._fail(req, send.sender)
        else:
            self.inflight.append(req)
        return True

    # ---- endings ----------------------------------------------------------------------------
    def _fail(self, req: Req, sender: KVSender) -> None:
        self.num_transfer_failures += 1
        self._finish(req, transfer_failure(req, sender))

    def on_finish(self, req: Req) -> PageFate:
        send = self.sends.pop(req, None)
        if send is not None and send.sender.poll() not in (KVPoll.Success, KVPoll.Failed):
            send.sender.abort((req.finish_reason.message if req.finish_reason else None) or "aborted")
        if req in self.bootstrap_queue:
            self.bootstrap_queue.remove(req)
        if req in self.inflight:
            self.inflight.remove(req)
        # Computed prompt pages are good KV even when the transfer failed; but a failed or
        # aborted request may have stopped mid-chunk, so only successful ones are cached.
        failed = req.finish_reason is not None and req.finish_reason.type == "abort"
        return PageFate.FREE if failed else PageFate.CACHE

    def stats(self) -> dict[str, float]:
        s = super().stats()
        s["num_bootstrap_queue_reqs"] = float(len(self.bootstrap_queue))
        s["num_waiting_tokens"] += float(sum(len(r.origin_input_ids) for r in self.bootstrap_queue))
        s["num_inflight_queue_reqs"] = float(len(self.inflight))
        s["num_transfer_failures_total"] = float(self.num_transfer_failures)
        s["kv_pages_skipped_total"] = float(self.num_pages_skipped)
        s["kv_transfer_total_seconds"] = self.transfer_total_seconds
        s["kv_transfer_exposed_seconds"] = self.transfer_exposed_seconds
        s.update(transfer_stats(self.transfer))
        return s
