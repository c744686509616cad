"""Incremental, UTF-8-safe detokenization and stop-string matching, one request each.

Owned by the frontend's per-request state; the engine only sends token ids.

IncrementalDetokenizer keeps a small window of ids and decodes it twice per step:

    ids:   [ ... ctx ... | already emitted | new ]
                         ^prefix_offset    ^read_offset
    prefix_text = decode(ids[prefix_offset:read_offset])
    full_text   = decode(ids[prefix_offset:])
    delta       = full_text[len(prefix_text):]

A delta that ends in U+FFFD is an incomplete multi-byte character: nothing is
emitted and the offsets stay, until a later token completes it (or `flush` at
finish emits it as is). The window starts with up to CONTEXT_TOKENS prompt ids
so that tokenizers which drop a leading space at the start of a decode
(SentencePiece) still produce the right first characters.

StopStringMatcher trims the text before the first stop string and, while
streaming, holds back any tail that could still become the start of one.
"""

from __future__ import annotations

from typing import Any, NamedTuple

CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        ctx = list(prompt_ids[-CONTEXT_TOKENS:])
        while ctx and self._decode(ctx).endswith(_REPLACEMENT):
            ctx.pop(0)
        self._ids: list[int] = ctx
        self._prefix_offset = 0
        self._read_offset = len(ctx)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def step(self, new_ids: list[int]) -> str:
        """Text that became final with `new_ids` (possibly "")."""
        self._ids.extend(new_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """At finish: whatever is still held back, replacement characters included."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]


class StopCheck(NamedTuple):
    emit: str  # text now safe to show the client
    matched: str | None  # the stop string that ended the request, if any


class StopStringMatcher:
    """Text in, client-safe text out; trims at the first (leftmost) stop string."""

    def __init__(self, stops: list[str], *, keep_stop: bool = False) -> None:
        self._keep_stop = keep_stop  # SGLang's no_stop_trim: the matched stop string stays in the text
        self._stops = [s for s in stops if s]
        self._max_len = max((len(s) for s in self._stops), default=0)
        self._text = ""
        self._emitted = 0
        self.matched: str | None = None

    @property
    def text(self) -> str:
        """The whole visible text so far (trimmed at the stop string once matched)."""
        return self._text

    def feed(self, delta: str, *, final: bool = False) -> StopCheck:
        if self.matched is not None:
            return StopCheck("", self.matched)
        search_from = max(0, len(self._text) - self._max_len + 1)
        self._text += delta
        hit = self._find(search_from)
        if hit is not None:
            pos, stop = hit
            self._text = self._text[: pos + (len(stop) if self._keep_stop else 0)]
            self.matched = stop
            return StopCheck(self._take(len(self._text)), stop)
        if final:
            return StopCheck(self._take(len(self._text)), None)
        return StopCheck(self._take(len(self._text) - self._held_back()), None)

    def _find(self, start: int) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            pos = self._text.find(stop, start)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        return best

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        tail_max = min(len(self._text) - self._emitted, self._max_len - 1)
        for n in range(tail_max, 0, -1):
            tail = self._text[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0

    def _take(self, end: int) -> str:
        end = max(end, self._emitted)
        out = self._text[self._emitted : end]
        self._emitted = end
        return out


class TextUpdate(NamedTuple):
    delta: str
    matched_stop: str | None


class RequestDetokenizer:
    """Ids -> client text for one request: incremental decode, then stop strings."""

    def __init__(
        self, tokenizer: Any, prompt_ids: list[int], *, stops: list[str], skip_special_tokens: bool,
        keep_stop: bool = False,
    ) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
        self._stops = StopStringMatcher(stops, keep_stop=keep_stop)

    @property
    def text(self) -> str:
        return self._stops.text

    def step(self, new_ids: list[int], *, finished: bool) -> TextUpdate:
        text = self._detok.step(new_ids)
        if finished:
            text += self._detok.flush()
        check = self._stops.feed(text, final=finished)
        return TextUpdate(check.emit, check.matched)
