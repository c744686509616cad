"""Which decode (and whether a prefill at all) serves a request in PD mode.

    decode:  1. the decode that served the session's last turn (x-session-id / `user`),
                while it is available and not overloaded;
             2. else the decode whose prefix cache holds the most of the prompt, as its KV
                events say (router/kv_index.py), when that covers >= cache_threshold of the
                prompt and it is not overloaded;
             3. else the decode policy.
    prefill: none when the chosen decode holds all but at most its local prefill limit of
             the prompt (it then prefills the suffix itself, no transfer); else the prefill
             policy.

"Overloaded" is the cache_aware policy's imbalance rule. Owned by the Dispatcher; on the
event loop, cheap: prompt page hashes are computed once per request and only when some
decode publishes KV events.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from common.cache.kv_events import PromptHashes
from router.config import RouterConfig
from router.errors import bad_request
from router.plan import GenerationPlan
from router.policies import ExactMatch, imbalanced
from router.registry import WorkerRegistry
from router.worker import Worker

MAX_SESSIONS = 100_000
MAX_SESSION_ID_CHARS = 256


def session_key(value: object) -> str:
    """A bounded key for a client's session id (header x-session-id or the OpenAI `user` field)."""
    if not isinstance(value, str) or len(value) > MAX_SESSION_ID_CHARS:
        raise bad_request(f"'user' / x-session-id must be a string of at most {MAX_SESSION_ID_CHARS} characters",
                          "user")
    return hashlib.blake2b(value.encode(), digest_size=12).hexdigest()


class SessionAffinity:
    """session key -> the decode that served its last turn; least recently used dropped past the cap."""

    def __init__(self, max_sessions: int = MAX_SESSIONS) -> None:
        self.max_sessions = max_sessions
        self._last: OrderedDict[str, str] = OrderedDict()

    def get(self, key: str) -> str | None:
        url = self._last.get(key)
        if url is not None:
            self._last.move_to_end(key)
        return url

    def remember(self, key: str, url: str) -> None:
        self._last[key] = url
        self._last.move_to_end(key)
        while len(self._last) > self.max_sessions:
            self._last.popitem(last=False)

    def __len__(self) -> int:
        return len(self._last)


@dataclass(frozen=True)
class Pair:
    decode: Worker
    prefill: Worker | None  # None: decode prefills the prompt itself from its prefix cache
    reason: str  # session, cache or policy: why this decode
    cached_tokens: int | None  # of the prompt, in decode's cache per its KV events (None: unknown)


class PairChooser:
    def __init__(self, cfg: RouterConfig, registry: WorkerRegistry, cached_tokens: ExactMatch) -> None:
        self.cfg = cfg
        self.registry = registry
        self.cached_tokens = cached_tokens  # KVIndexes.cached_tokens
        self.sessions = SessionAffinity()

    def choose(self, plan: GenerationPlan, exclude: frozenset[str],
               prefer: Callable[[Worker], bool] | None = None) -> Pair:
        """`prefer`: decodes with room for the request (router/admission.py), when any has."""
        ids = plan.input_ids
        candidates = self.registry.candidates("decode", exclude, prefer)
        hashes: dict[int, PromptHashes] = {}
        cached = {w.url: self.cached_tokens(w, ids, hashes) for w in candidates}
        decode, reason = self._decode(plan, candidates, cached)
        if plan.session_id is not None:
            self.sessions.remember(plan.session_id, decode.url)
        hit = cached[decode.url]
        if hit is not None and self._local(plan, decode, hit):
            return Pair(decode, None, reason, hit)
        return Pair(decode, self.registry.select("prefill", ids, exclude), reason, hit)

    def _decode(self, plan: GenerationPlan, candidates: Sequence[Worker],
                cached: dict[str, int | None]) -> tuple[Worker, str]:
        ok = [w for w in candidates if not self._overloaded(w, candidates)]
        if plan.session_id is not None:
            url = self.sessions.get(plan.session_id)
            sticky = next((w for w in ok if w.url == url), None)
            if sticky is not None:
                return sticky, "session"
        known = [w for w in ok if cached[w.url]]
        if known and plan.input_ids:
            best = max(known, key=lambda w: (cached[w.url] or 0, -w.load))
            if (cached[best.url] or 0) >= self.cfg.cache_threshold * len(plan.input_ids):
                return best, "cache"
        return self.registry.policies["decode"].select(candidates, plan.input_ids), "policy"

    def _overloaded(self, w: Worker, candidates: Sequence[Worker]) -> bool:
        return imbalanced(w, candidates, self.cfg.balance_abs_threshold, self.cfg.balance_rel_threshold)

    @staticmethod
    def _local(plan: GenerationPlan, decode: Worker, cached: int) -> bool:
        info = decode.cache_info
        if info is None or info.local_prefill_max_tokens <= 0 or not plan.local_prefill_allowed:
            return False
        return len(plan.input_ids) - cached <= info.local_prefill_max_tokens
