"""Decode role: receive prompt KV from prefill, then decode in the overlap loop.

    request ─> prealloc queue (handshake with its prefill; admission when memory allows:
               row + pages for the whole prompt + an aux slot -> receiver.init)
           ─> transfer queue (poll) ─ Success & room matches ─> PREBUILT: first token from
              the aux row streamed at once, request merged into the running batch in the
              same iteration (no forward) ─> decode ... finish
                                     └ Failed ─> client error; pages wait in the drain
                                                 queue until prefill acked its writes
    retract (memory short): KV copied to host, pages freed; restored into new pages when
    memory allows (no re-prefill). While any request waits there, nothing is admitted.

Admission reserves, per running or transferring request,
max(new_token_ratio x min(remaining new tokens, 4096), min(remaining, --num-reserved-decode-tokens)).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from common.cache import TreeNode
from common.cache.kv_pool import KVPool
from common.disaggregation import transfer_failure, transfer_stats
from common.scheduler.config import SchedulerConfig
from common.scheduler.executor import Executor
from common.scheduler.kv_manager import ReqKVManager
from common.scheduler.messages import FinishReason
from common.scheduler.req import Req, ReqState
from common.scheduler.scheduler import OutputSink, PageFate, Scheduler
from kv_transfer import AuxSlotAllocator, KVManager, KVPoll, KVReceiver

logger = logging.getLogger(__name__)


@dataclass
class DecodeTransfer:
    """One request's KV arrival, owned by the DecodeScheduler from intake to its release."""

    receiver: KVReceiver
    aux_slot: int | None = None  # held from init() until the aux row is read or the pages drain
    host_kv: tuple[torch.Tensor, torch.Tensor] | None = None  # K, V while retracted
    waited_for_memory: bool = False  # held in the prealloc queue (its prefill holds it too) for KV


class DecodeScheduler(Scheduler):
    def __init__(
        self, cfg: SchedulerConfig, executor: Executor, kv: ReqKVManager, *, future_capacity: int, output: OutputSink,
        transfer: KVManager, aux_slots: AuxSlotAllocator, kv_pool: KVPool, num_reserved_decode_tokens: int,
        local_prefill_max_tokens: int = 0, swap_space_bytes: int | None = None,
    ) -> None:
        super().__init__(cfg, executor, kv, future_capacity=future_capacity, output=output)
        assert kv.defer_frees, "decode frees pages only after the step in flight (see kv_manager.py)"
        self.num_reserved_decode_tokens = num_reserved_decode_tokens
        self.transfer = transfer
        self.aux_slots = aux_slots
        self.kv_pool = kv_pool
        self.transfers: dict[Req, DecodeTransfer] = {}
        self.prealloc: list[Req] = []
        self.transferring: list[Req] = []
        self.draining: list[Req] = []
        self.retracted: list[Req] = []
        self.num_transfer_failures = 0
        self.num_prebuilt = 0
        self.num_pages_from_cache = 0  # prompt pages found in the prefix cache instead of transferred
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.num_local_prefill = 0  # requests without bootstrap info, prefilled here
        self.num_local_prefill_tokens = 0
        self.num_local_prefill_cache_misses = 0
        self.swap_space_bytes = swap_space_bytes  # None: unbounded
        self.host_kv_bytes = 0  # held by retracted requests' host copies
        self.num_swap_space_refusals = 0
        self.num_prealloc_memory_waits = 0  # requests held back at least once for KV memory

    @property
    def has_work(self) -> bool:
        return self.has_runnable_work or bool(self.prealloc or self.transferring or self.draining or self.retracted)

    # ---- intake -----------------------------------------------------------------------------
    def enqueue(self, req: Req) -> None:
        boot = req.bootstrap
        if boot is None:  # local prefill: computed here, from what the prefix cache holds
            assert not self.kv.radix.disable, f"local prefill without decode's prefix cache: {req}"
            self.num_local_prefill += 1
            self.waiting.append(req)
            return
        self.transfers[req] = DecodeTransfer(self.transfer.create_receiver(req.rid, boot.room, boot.host, boot.port))
        self.prealloc.append(req)

    def on_prompt_scheduled(self, req: Req) -> None:
        """A local prefill's last chunk is scheduled: it decodes here next, as colocated."""
        computed = len(req.origin_input_ids) - req.cached_tokens
        self.num_local_prefill_tokens += computed
        if computed > self.local_prefill_max_tokens and req.retractions == 0:
            self.num_local_prefill_cache_misses += 1  # evicted since the router looked: slower, still right
        super().on_prompt_scheduled(req)

    def _receiver(self, req: Req) -> KVReceiver:
        return self.transfers[req].receiver

    def poll_transfers(self) -> None:
        self._release_drained()
        self._poll_transferring()
        if self.retracted:
            self._restore_retracted()
        self._admit_preallocated()

    # ---- admission --------------------------------------------------------------------------
    def reservation(self, req: Req) -> int:
        remaining = req.remaining_new_tokens
        by_ratio = int(min(remaining, self.cfg.clip_max_new_tokens_estimation) * self.ratio.value)
        return max(by_ratio, min(remaining, self.num_reserved_decode_tokens))

    def _free_budget_tokens(self) -> int:
        reserved = sum(self.reservation(r) for r in self.running if not r.finished)
        reserved += sum(self.reservation(r) for r in self.transferring)
        return self.kv.available_tokens() - reserved

    def _admit_preallocated(self) -> None:
        budget = self._free_budget_tokens()
        queue, still = list(self.prealloc), []
        for i, req in enumerate(queue):
            receiver = self._receiver(req)
            if receiver.poll() == KVPoll.Failed:
                self._fail(req, receiver)
                continue
            if self.retracted or len(self.running) + len(self.transferring) >= self.cfg.max_running_requests:
                still.extend(queue[i:])
                break
            prompt = len(req.origin_input_ids)
            held, node = self._cached_prefix(req)
            need = -(-prompt // self.kv.page_size) * self.kv.page_size - len(held)
            if self.running or self.transferring:  # reservations protect requests already in
                need += self.reservation(req)
            fits = need <= budget and self.kv.req_pool.num_free > 0 and self.aux_slots.num_free > 0
            if not (fits and self.kv.attach_prefix(req, held, node) and self._alloc_prompt(req, prompt - len(held))):
                self._wait_for_memory(req)
                still.extend(queue[i:])
                break
            slot = self.aux_slots.alloc()
            assert slot is not None
            self.transfers[req].aux_slot = slot
            pages = self.kv.allocator.pages_of(req.kv_slots[len(held):])
            skip = len(held) // self.kv.page_size
            receiver.init(pages, slot, skip_pages=skip)
            self.num_pages_from_cache += skip
            budget -= need
            self.transferring.append(req)
        self.prealloc = still

    def _alloc_prompt(self, req: Req, num_tokens: int) -> bool:
        """Pages for the prompt tokens the prefix cache does not hold; on failure the attached
        prefix is let go too."""
        if self.kv.alloc_tokens(req, num_tokens) is None:
            self.kv.release(req, keep_in_cache=False)
            return False
        return True

    def _wait_for_memory(self, req: Req) -> None:
        transfer = self.transfers[req]
        if not transfer.waited_for_memory:
            transfer.waited_for_memory = True
            self.num_prealloc_memory_waits += 1

    def _cached_prefix(self, req: Req) -> tuple[list[int], TreeNode]:
        """The whole pages of req's prompt this decode's prefix cache holds (empty without the
        cache); at least the prompt's last page is always transferred."""
        if self.kv.radix.disable:
            return [], self.kv.radix.root
        ps = self.kv.page_size
        limit = (len(req.origin_input_ids) - 1) // ps * ps
        return self.kv.match_prefix(req.origin_input_ids[:limit])

    # ---- transfer completion ----------------------------------------------------------------
    def _poll_transferring(self) -> None:
        for req in list(self.transferring):
            receiver = self._receiver(req)
            state = receiver.poll()
            if state == KVPoll.Success:
                self.transferring.remove(req)
                self._prebuilt(req, receiver)
            elif state == KVPoll.Failed:
                self._fail(req, receiver)  # on_finish takes it out of the queue

    def _prebuilt(self, req: Req, receiver: KVReceiver) -> None:
        """Join the running batch without a forward: the prompt KV is in place, the first
        token comes from the aux row (its own KV is written by the first decode step)."""
        row = receiver.aux_row()
        self._free_aux_slot(req)
        if row is None or row.room != receiver.room:
            self._finish(req, FinishReason("abort", message="KV transfer aux row does not match the room",
                                           status_code=500, err_type="corruption"))
            return
        self.num_prebuilt += 1
        req.output_ids.append(row.first_token)
        if req.return_logprob and row.logprob is not None:
            req.output_logprobs.append(row.logprob)
            if req.top_logprobs_num:
                req.output_top_logprobs.append(list(row.top_logprobs[: req.top_logprobs_num]))
        req.cached_tokens = row.cached_tokens
        req.needs_sampler_reset = True
        # prefill sampled the first token under the same grammar: replay it into decode's matcher
        if req.grammar is not None and not self.accept_grammar_token(req, row.first_token):
            return
        reason = self.finish_reason_after(req, row.first_token)
        if reason is not None:
            self._finish(req, reason)
            return
        req.state = ReqState.RUNNING
        self.running.append(req)
        if req.stream:
            self._emit(req)

    def _fail(self, req: Req, receiver: KVReceiver) -> None:
        self.num_transfer_failures += 1
        self._finish(req, transfer_failure(req, receiver))

    def _free_aux_slot(self, req: Req) -> None:
        transfer = self.transfers.get(req)
        if transfer is not None and transfer.aux_slot is not None:
            self.aux_slots.free(transfer.aux_slot)
            transfer.aux_slot = None

    def _release_drained(self) -> None:
        still: list[Req] = []
        for req in self.draining:
            if self._receiver(req).pages_releasable():
                self.kv.release(req, keep_in_cache=False)
                self._free_aux_slot(req)
                del self.transfers[req]
            else:
                still.append(req)
        self.draining = still

    # ---- retraction with a host copy ----------------------------------------------------------
    def can_retract_last(self, req: Req) -> bool:
        # Transfers in flight hold pages that come free as their requests finish; the request
        # waits as a host copy. Alone in the pool it could never fit: that one fails.
        return bool(self.transferring or self.draining)

    def on_retract(self, req: Req) -> None:
        if req not in self.transfers:  # a local prefill: back to the waiting queue, its KV cached
            super().on_retract(req)
            self.kv.free_deferred()  # the worker is quiet: the caching release happens now
            return
        assert req.num_pending == 0 and self.in_flight is None, "retract needs a quiet worker"
        nbytes = self.kv_pool.host_copy_bytes(len(req.kv_slots))
        if self.swap_space_bytes is not None and self.host_kv_bytes + nbytes > self.swap_space_bytes:
            self.num_swap_space_refusals += 1
            held = self.host_kv_bytes / 2**30
            self._finish(req, FinishReason(
                "abort", status_code=503, err_type="out_of_memory",
                message=f"decode ran out of KV memory and its host swap space is full: this request's KV "
                        f"({nbytes / 2**20:.1f} MiB) does not fit in --swap-space "
                        f"{self.swap_space_bytes / 2**30:g} GiB ({held:.2f} GiB held)"))
            return
        slots = torch.tensor(req.kv_slots, dtype=torch.int64, device=self.kv_pool.device)
        self.transfers[req].host_kv = self.kv_pool.copy_slots_to_host(slots)
        self.host_kv_bytes += nbytes
        self.kv.release(req, keep_in_cache=False)
        self.running.remove(req)
        req.state = ReqState.RETRACTED
        req.retractions += 1
        self.retracted.append(req)

    def _restore_retracted(self) -> None:
        ps = self.kv.page_size
        while self.retracted:
            req = self.retracted[0]
            host_kv = self.transfers[req].host_kv
            assert host_kv is not None, f"retracted request without a host copy: {req}"
            k, v = host_kv
            tokens = int(k.shape[1])
            need = -(-tokens // ps) * ps + self.reservation(req) + len(self.running) * ps
            if need > self._free_budget_tokens() or self.kv.req_pool.num_free == 0:
                return
            self._resolve_in_flight()  # the worker must be idle while we write KV from here
            self.kv.free_deferred()
            if not self.kv.attach_prefix(req, [], self.kv.radix.root):
                return
            slots = self.kv.alloc_tokens(req, tokens)
            if slots is None:
                self.kv.release(req, keep_in_cache=False)
                return
            index = torch.tensor(slots, dtype=torch.int64, device=self.kv_pool.device)
            self.kv_pool.restore_slots_from_host(index, k, v)
            self._drop_host_kv(self.transfers[req])
            self.retracted.pop(0)
            req.needs_sampler_reset = True
            req.state = ReqState.RUNNING
            self.running.append(req)

    def _drop_host_kv(self, transfer: DecodeTransfer) -> None:
        if transfer.host_kv is not None:
            self.host_kv_bytes -= sum(t.numel() * t.element_size() for t in transfer.host_kv)
            transfer.host_kv = None

    # ---- endings ----------------------------------------------------------------------------
    def on_finish(self, req: Req) -> PageFate:
        transfer = self.transfers.get(req)
        receiver = transfer.receiver if transfer is not None else None
        if transfer is not None:
            self._drop_host_kv(transfer)
        if req in self.prealloc:
            self.prealloc.remove(req)
        if req in self.retracted:
            self.retracted.remove(req)
        if req in self.transferring:
            self.transferring.remove(req)
        if receiver is not None and receiver.poll() not in (KVPoll.Success, KVPoll.Failed):
            receiver.abort((req.finish_reason.message if req.finish_reason else None) or "aborted")
        if receiver is not None and not receiver.pages_releasable():
            self.draining.append(req)  # late WRITEs may still land in these pages
            return PageFate.KEEP
        self._free_aux_slot(req)
        self.transfers.pop(req, None)
        # Only KV that fully arrived (or was computed here) may be reused by later requests.
        arrived = receiver is None or receiver.poll() == KVPoll.Success
        return PageFate.CACHE if arrived and not self.kv.radix.disable else PageFate.FREE

    def stats(self) -> dict[str, float]:
        s = super().stats()
        s.update(
            {
                "num_prealloc_queue_reqs": float(len(self.prealloc)),
                "num_transfer_queue_reqs": float(len(self.transferring)),
                "num_draining_reqs": float(len(self.draining)),
                "num_retracted_reqs": float(len(self.retracted)),
                "host_kv_bytes": float(self.host_kv_bytes),
                "num_swap_space_refusals_total": float(self.num_swap_space_refusals),
                "num_prealloc_memory_waits_total": float(self.num_prealloc_memory_waits),
                "num_transfer_failures_total": float(self.num_transfer_failures),
                "num_prebuilt_total": float(self.num_prebuilt),
                "kv_pages_from_cache_total": float(self.num_pages_from_cache),
                "num_local_prefill_total": float(self.num_local_prefill),
                "local_prefill_tokens_total": float(self.num_local_prefill_tokens),
                "num_local_prefill_cache_miss_total": float(self.num_local_prefill_cache_misses),
            }
        )
        s.update(transfer_stats(self.transfer))
        return s
