"""One request as the scheduler sees it.

Token bookkeeping (the scheduler thread is the only writer):

    fill_ids = origin_input_ids + output_ids        (+ pending tokens not yet known)
    kv_slots[i] = KV slot of token i, for i < kv_len  (allocated; written once the
                                                      batch that computes it has run)
    |<------- tree_len ------->|<---- request-owned ---->|
    [ radix-tree pages (locked) | own pages ... partial   ]
    0                          tree_len               kv_len

tree_len is page aligned, so request-owned slots start on a page boundary and
the request frees exactly pages_of(kv_slots[tree_len:]).

In the overlap loop a request can be scheduled for step N+1 before step N's
token is known: `num_pending` counts such tokens and `last_future` is the
FutureMap index that the worker fills with the newest one.
"""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from common.grammar.matcher import RequestGrammar
from common.sampling_params import SamplingParams
from common.scheduler.messages import BootstrapInfo, FinishReason


class ReqState(enum.Enum):
    WAITING = "waiting"
    CHUNKED = "chunked"  # part of the prompt computed, more chunks to go
    RUNNING = "running"
    RETRACTED = "retracted"  # evicted from the running batch for memory; waits to be re-admitted
    FINISHED = "finished"


@dataclass(eq=False)
class Req:
    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    priority: int = 0
    eos_token_ids: frozenset[int] = frozenset()
    bootstrap: BootstrapInfo | None = None  # PD: the prefill peer and room of this request's KV
    logprob_start_len: int = -1  # >= 0: report logprobs of prompt tokens [logprob_start_len, prompt_len)
    arrival_time: float = field(default_factory=time.monotonic)

    state: ReqState = ReqState.WAITING
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    # prompt logprobs (logprob_start_len >= 0): entry j is that of prompt token logprob_start_len + j
    # (None for token 0, which has no context); filled chunk by chunk, sent once with the first TokenOut
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    input_logprobs_sent: bool = False

    # KV memory
    req_pool_idx: int | None = None
    kv_slots: list[int] = field(default_factory=list)
    tree_len: int = 0
    last_node: Any = None  # locked RadixCache node covering kv_slots[:tree_len]
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (reported to the client)

    # current prefill chunk (set by the PrefillAdder)
    extend_len: int = 0
    # overlap bookkeeping
    num_pending: int = 0
    last_future: int | None = None
    # streaming bookkeeping: index of the first output token not yet sent
    sent_len: int = 0
    retractions: int = 0
    needs_sampler_reset: bool = False
    # structured output: the compile this request waits for, then its matcher (common/grammar)
    grammar_future: Future[Any] | None = None
    grammar: RequestGrammar | None = None

    @property
    def kv_len(self) -> int:
        return len(self.kv_slots)

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def num_output_scheduled(self) -> int:
        """Output tokens known plus those sampled by in-flight steps."""
        return len(self.output_ids) + self.num_pending

    @property
    def remaining_new_tokens(self) -> int:
        return max(0, self.sampling_params.max_new_tokens - self.num_output_scheduled)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs still to compute (a retracted request re-prefills without them)."""
        return self.logprob_start_len >= 0 and self.num_prompt_logprobs_done < len(self.origin_input_ids) - max(
            self.logprob_start_len, 1)

    @property
    def num_prompt_logprobs_done(self) -> int:
        """Computed prompt logprobs, not counting the None of token 0."""
        return len(self.input_logprobs) - (1 if self.logprob_start_len == 0 else 0)

    def prompt_logprob_targets(self, start: int, n: int) -> tuple[int, list[int]]:
        """For a step computing tokens [start, start + n): (index in the step of the first position
        whose logits score a reported prompt token, the ids of those tokens, in order)."""
        first = max(start + 1, self.logprob_start_len, 1)  # first prompt token scored by this step
        last = min(start + n, len(self.origin_input_ids) - 1)
        if first > last:
            return 0, []
        return first - 1 - start, self.origin_input_ids[first : last + 1]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def check_finished(self, new_token: int) -> FinishReason | None:
        """Finish rule applied after `new_token` was appended to output_ids."""
        params = self.sampling_params
        if new_token in params.stop_token_ids:
            return FinishReason("stop", matched_token=new_token)
        if not params.ignore_eos and new_token in self.eos_token_ids:
            return FinishReason("stop", matched_token=new_token)
        if len(self.output_ids) >= params.max_new_tokens:
            return FinishReason("length")
        return None

    def __repr__(self) -> str:
        return (
            f"Req(rid={self.rid!r}, state={self.state.value}, prompt={len(self.origin_input_ids)}, "
            f"out={len(self.output_ids)}+{self.num_pending}, kv={self.kv_len}, tree={self.tree_len})"
        )
