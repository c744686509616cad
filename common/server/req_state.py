"""Per-request state at the frontend and the /generate output records.

ReqState is owned by the TokenizerManager from `start` until `release`; the
engine's TokenOut deltas are folded in by `apply`, which returns one Chunk (the
delta a streaming client sees). `Chunk.to_json` and `merge_chunks` produce the
shapes of docs/generate_api.md.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from common.server.detokenizer import RequestDetokenizer
from common.server.io_struct import FinishReason, GenerateReq, TokenOut
from common.server.protocol import ApiError
from common.server.stream_cutoff import StreamCutOff


@dataclass
class Chunk:
    """What changed since the previous chunk; counts are cumulative, the rest are deltas."""

    rid: str
    text: str
    output_ids: list[int]
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    token_logprobs: list[list[Any]] | None = None
    top_logprobs: list[list[list[Any]]] | None = None
    # prompt logprobs, in the chunk that carries them (SGLang: [logprob | None, token id(, text)])
    input_token_logprobs: list[list[Any]] | None = None
    input_top_logprobs: list[list[list[Any]] | None] | None = None

    def to_json(self) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
        }
        if self.token_logprobs is not None:
            meta["output_token_logprobs"] = self.token_logprobs
        if self.top_logprobs is not None:
            meta["output_top_logprobs"] = self.top_logprobs
        if self.input_token_logprobs is not None:
            meta["input_token_logprobs"] = self.input_token_logprobs
        if self.input_top_logprobs is not None:
            meta["input_top_logprobs"] = self.input_top_logprobs
        return {"text": self.text, "output_ids": self.output_ids, "meta_info": meta}


def merge_chunks(chunks: list[Chunk]) -> Chunk:
    """The non-streaming response: all deltas concatenated, counts from the last chunk."""
    assert chunks, "a finished request has at least one chunk"
    last = chunks[-1]
    merged = Chunk(
        rid=last.rid,
        text="".join(c.text for c in chunks),
        output_ids=[t for c in chunks for t in c.output_ids],
        finish_reason=last.finish_reason,
        prompt_tokens=last.prompt_tokens,
        completion_tokens=last.completion_tokens,
        cached_tokens=last.cached_tokens,
    )
    if any(c.token_logprobs is not None for c in chunks):
        merged.token_logprobs = [x for c in chunks for x in (c.token_logprobs or [])]
    if any(c.top_logprobs is not None for c in chunks):
        merged.top_logprobs = [x for c in chunks for x in (c.top_logprobs or [])]
    for c in chunks:
        if c.input_token_logprobs is not None:
            merged.input_token_logprobs = c.input_token_logprobs
            merged.input_top_logprobs = c.input_top_logprobs
    return merged


class CumulativeStream:
    """SGLang's default stream: each event carries the text, ids and output logprobs so far; the
    prompt's logprobs only once, in the event that brought them (re-sending them in every event
    cost O(prompt x tokens) bytes)."""

    def __init__(self) -> None:
        self._text: list[str] = []
        self._ids: list[int] = []
        self._lps: list[list[Any]] | None = None
        self._tops: list[list[list[Any]]] | None = None

    def add(self, chunk: Chunk) -> Chunk:
        self._text.append(chunk.text)
        self._ids.extend(chunk.output_ids)
        if chunk.token_logprobs is not None:
            self._lps = (self._lps or []) + chunk.token_logprobs
        if chunk.top_logprobs is not None:
            self._tops = (self._tops or []) + chunk.top_logprobs
        out = Chunk(
            rid=chunk.rid, text="".join(self._text), output_ids=list(self._ids), finish_reason=chunk.finish_reason,
            prompt_tokens=chunk.prompt_tokens, completion_tokens=chunk.completion_tokens,
            cached_tokens=chunk.cached_tokens, token_logprobs=self._lps, top_logprobs=self._tops,
        )
        if chunk.input_token_logprobs is not None:
            out.input_token_logprobs = chunk.input_token_logprobs
            out.input_top_logprobs = chunk.input_top_logprobs
        return out


def finish_reason_json(reason: FinishReason) -> dict[str, Any]:
    out: dict[str, Any] = {"type": reason.type}
    if reason.matched_token is not None:
        out["matched"] = reason.matched_token
    if reason.message is not None:
        out["message"] = reason.message
    return out


QueueItem = TokenOut | ApiError


@dataclass
class ReqState:
    req: GenerateReq
    detok: RequestDetokenizer | None  # None on a prefill instance: its response is meta only
    incremental: bool = False  # stream deltas (else SGLang's cumulative events)
    token_text: Callable[[int], str] | None = None  # return_text_in_logprobs: token id -> its text
    queue: asyncio.Queue[QueueItem] = field(default_factory=asyncio.Queue)
    created_at: float = field(default_factory=time.monotonic)
    last_token_at: float | None = None
    first_token_latency: float | None = None
    completion_tokens: int = 0
    engine_done: bool = False  # the engine finished it or was told to abort it
    finished: bool = False  # the client got its last chunk (or error)
    released: bool = False
    cut_off: StreamCutOff = field(default_factory=StreamCutOff)  # a streaming client that stopped reading

    @property
    def rid(self) -> str:
        return self.req.rid

    def apply(self, out: TokenOut) -> Chunk:
        """Fold one engine delta in. Raises ApiError when the engine ended it with an error."""
        reason = out.finish_reason
        if reason is not None:
            self.engine_done = True
            if reason.type == "abort" and reason.status_code != 200:
                self.finished = True
                raise ApiError(reason.status_code, reason.message or "request failed in the engine", reason.err_type)
        self.completion_tokens = out.completion_tokens
        finish = finish_reason_json(reason) if reason is not None else None
        ids = list(out.new_token_ids)
        text = ""
        if self.detok is None:
            ids = []
        else:
            update = self.detok.step(ids, finished=reason is not None)
            text = update.delta
            if update.matched_stop is not None:
                finish = {"type": "stop", "matched": update.matched_stop}
        self.finished = finish is not None
        chunk = Chunk(
            rid=self.rid,
            text=text,
            output_ids=ids,
            finish_reason=finish,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens,
        )
        if self.req.return_logprob and self.detok is not None:
            chunk.token_logprobs = [self._entry(lp, t) for lp, t in zip(out.new_token_logprobs or [], ids, strict=False)]
            if self.req.top_logprobs_num:
                chunk.top_logprobs = [
                    [self._entry(lp, t) for t, lp in position] for position in (out.new_top_logprobs or [])
                ]
        if out.input_logprobs is not None:
            prompt = self.req.input_ids[self.req.logprob_start_len :]
            chunk.input_token_logprobs = [self._entry(lp, t) for lp, t in zip(out.input_logprobs, prompt, strict=False)]
            if out.input_top_logprobs is not None:
                chunk.input_top_logprobs = [
                    [self._entry(lp, t) for t, lp in position] if position else None for position in out.input_top_logprobs
                ]
        return chunk

    def _entry(self, logprob: float | None, token: int) -> list[Any]:
        if self.token_text is None:
            return [logprob, token]
        return [logprob, token, self.token_text(token)]
