"""Request migration: a stream that loses its decode continues on a new pair (Dynamo's idea).

    Migration(plan, max_migrations)
      record(ev)        every event handed to the client: its output ids are kept
      allows(err)       decode failed after the first byte: retryable, blamed on decode,
                        budget left, tokens still to generate, no stop strings
      next_plan()       prompt + tokens already sent, max_new_tokens reduced by them
      adapt(ev)         events of a migrated attempt, rewritten as the client's one request:
                        prompt_tokens and completion_tokens count from the original prompt

What holds after a migration (README "Request migration"): no gap, no repeated token and
one [DONE]; greedy outputs equal the unmigrated request's (the prefix is recomputed by a
prefill; parity holds in fp32); usage counts the original prompt and every generated token.
A seeded sampler continues from the same position: its noise is a function of (seed, step)
(common/model/sampler.py: splitmix64 of seed * C + step + 1), and the new worker counts steps
from 0, so the migrated request carries seed + k * C^-1 (mod 2^64) and its step j draws the
noise of step k + j; with the same logits it samples the same tokens. Not kept across a
migration: frequency/presence penalties over the tokens before the cut (they become prompt),
and text a worker held back at the cut for an incomplete UTF-8 character. A request with stop
strings is never migrated (a worker holds back any tail that could start one, and a stop
string could span the cut: its text could silently lose characters); it gets the error. A
constrained request (json_schema / regex / ebnf) carries grammar_prefix_len = the tokens already
generated: both new instances replay them into their matchers before sampling.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from common.grammar.spec import grammar_of
from router.errors import UpstreamError
from router.plan import GenerationPlan
from router.upstream import WorkerEvent

_MASK64 = (1 << 64) - 1
_SEED_MUL_INV = pow(0x9E3779B97F4A7C15, -1, 1 << 64)  # the sampler's seed multiplier, inverted


def shifted_seed(seed: int, steps: int) -> int:
    """The seed whose step j draws the noise `seed` draws at step `steps` + j (signed 64-bit)."""
    x = (seed + steps * _SEED_MUL_INV) & _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


class Migration:
    """One request's migration state; owned by its dispatcher task."""

    def __init__(self, plan: GenerationPlan, max_migrations: int) -> None:
        self.origin = plan
        self.plan = plan
        self.budget = max_migrations
        self.count = 0
        self.generated: list[int] = []
        self._offset = 0  # tokens generated before the current attempt
        self._cached_tokens: Any = None
        self._first_id: Any = None

    def record(self, ev: WorkerEvent) -> None:
        ids = ev.data.get("output_ids")
        if ids:
            self.generated.extend(ids)
        if not self.count and self._first_id is None:
            meta = ev.data.get("meta_info") or {}
            self._cached_tokens, self._first_id = meta.get("cached_tokens"), meta.get("id")

    def allows(self, err: UpstreamError, decode_url: str) -> bool:
        return (self.count < self.budget and self.origin.worker_stream and err.retryable
                and err.worker_url == decode_url and len(self.generated) < self.origin.max_new_tokens
                and not self.origin.sampling_params.get("stop"))

    def next_plan(self) -> GenerationPlan:
        """The plan of the next attempt; call only when `allows` said yes."""
        self.count += 1
        self._offset = len(self.generated)
        o = self.origin
        sampling = dict(o.sampling_params)
        sampling["max_new_tokens"] = o.max_new_tokens - self._offset
        if sampling.get("seed") is not None:
            sampling["seed"] = shifted_seed(int(o.sampling_params["seed"]), self._offset)
        if grammar_of(sampling) is not None:  # the new pair's matchers replay the output so far
            sampling["grammar_prefix_len"] = int(o.sampling_params.get("grammar_prefix_len") or 0) + self._offset
        if "min_new_tokens" in sampling:
            sampling["min_new_tokens"] = max(0, int(sampling["min_new_tokens"] or 0) - self._offset)
        self.plan = dataclasses.replace(o, input_ids=[*o.input_ids, *self.generated], sampling_params=sampling,
                                        prompt_logprob_start=-1)
        return self.plan

    def adapt(self, ev: WorkerEvent) -> WorkerEvent:
        """An event as the client's single request would have had it (identity before a migration)."""
        if not self.count:
            return ev
        data = dict(ev.data)
        meta = dict(data.get("meta_info") or {})
        meta["prompt_tokens"] = len(self.origin.input_ids)
        if isinstance(meta.get("completion_tokens"), int):
            meta["completion_tokens"] += self._offset
        if self._cached_tokens is not None:
            meta["cached_tokens"] = self._cached_tokens
        if self._first_id is not None:
            meta["id"] = self._first_id
        data["meta_info"] = meta
        return WorkerEvent(msgspec.json.encode(data), data)
