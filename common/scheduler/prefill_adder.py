"""Fills one prefill (EXTEND) batch within three token budgets (DESIGN.md §4).

    rem_total  = free + evictable tokens
                 - sum over running requests of min(remaining new tokens, 4096) x new_token_ratio
    rem_input  = max_prefill_tokens          (all requests of this batch)
    rem_chunk  = chunked_prefill_size        (one request; longer prompts are chunked, page aligned)

A PrefillAdder lives for one scheduling round.
"""

from __future__ import annotations

import enum

from common.cache import TreeNode
from common.scheduler.config import SchedulerConfig
from common.scheduler.kv_manager import ReqKVManager
from common.scheduler.req import Req


class AddResult(enum.Enum):
    CONTINUE = "continue"  # added; try the next request
    NO_TOKEN = "no_token"  # out of KV memory: stop this round
    OTHER = "other"  # a batch budget is exhausted: stop this round


class PrefillAdder:
    def __init__(
        self, kv: ReqKVManager, running: list[Req], cfg: SchedulerConfig, *, new_token_ratio: float, max_new_reqs: int
    ) -> None:
        self.kv = kv
        self.cfg = cfg
        self.page_size = kv.page_size
        self.clip = cfg.clip_max_new_tokens_estimation
        self.ratio = new_token_ratio
        reserved = sum(self.reservation(r) for r in running)
        self.rem_total = kv.available_tokens() - reserved
        self.nothing_running = not running
        self.rem_input = cfg.max_prefill_tokens
        self.rem_chunk = cfg.chunk_tokens
        self.max_new_reqs = max_new_reqs
        self.can_run: list[Req] = []
        self.new_chunked: Req | None = None

    def reservation(self, req: Req) -> int:
        return int(min(req.remaining_new_tokens, self.clip) * self.ratio)

    def _budget_left(self) -> bool:
        return self.rem_input > 0 and (self.rem_chunk is None or self.rem_chunk > 0)

    def _chunk_len(self, extend: int) -> int:
        """How many of `extend` tokens fit this round (whole pages unless it is the rest)."""
        limit = extend
        if self.rem_chunk is not None:
            limit = min(limit, self.rem_chunk)
        if self.can_run:
            limit = min(limit, self.rem_input)
        if limit < extend:
            limit = limit // self.page_size * self.page_size
        return limit

    def add_chunked(self, req: Req) -> AddResult:
        """Continue a request whose prompt is partly computed (it already holds its row)."""
        return self._add(req, extend=len(req.fill_ids) - req.kv_len)

    def add_one(self, req: Req, prefix_slots: list[int], node: TreeNode) -> AddResult:
        if len(self.can_run) >= self.max_new_reqs:
            return AddResult.OTHER
        if not self._budget_left():
            return AddResult.OTHER
        extend = len(req.fill_ids) - len(prefix_slots)
        estimate = extend + self.reservation(req)
        # With nothing running, the reservation protects no one: admit whatever prompt fits
        # (else a request whose budget exceeds the pool would wait forever).
        if self.nothing_running and not self.can_run:
            estimate = extend
        if estimate > self.rem_total:
            return AddResult.NO_TOKEN
        before = self.kv.radix.evictable_pages
        if not self.kv.attach_prefix(req, prefix_slots, node):
            return AddResult.OTHER
        self.rem_total -= (before - self.kv.radix.evictable_pages) * self.page_size
        if req.retractions == 0:
            req.cached_tokens = len(prefix_slots)
        req.needs_sampler_reset = True
        result = self._add(req, extend=extend)
        if result is not AddResult.CONTINUE and req not in self.can_run:
            self.kv.release(req, keep_in_cache=False)
        return result

    def _add(self, req: Req, *, extend: int) -> AddResult:
        chunk = self._chunk_len(extend)
        if chunk <= 0:
            return AddResult.OTHER
        if self.kv.alloc_tokens(req, chunk) is None:
            return AddResult.NO_TOKEN
        req.extend_len = chunk
        self.can_run.append(req)
        self.rem_input -= chunk
        if self.rem_chunk is not None:
            self.rem_chunk -= chunk
        self.rem_total -= chunk + (self.reservation(req) if chunk == extend else 0)
        if chunk < extend:
            self.new_chunked = req
            return AddResult.OTHER
        return AddResult.CONTINUE
