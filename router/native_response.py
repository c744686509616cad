"""/generate answers the router builds from worker events (docs/generate_api.md).

Workers always stream deltas to the router. A client stream is SGLang's cumulative one by
default (every event carries the text, ids and output logprobs so far), deltas with
--incremental-streaming-output or a request's `incremental_stream: true`; the prompt's
logprobs (input_*_logprobs) go out once, in the first event, in either mode. The cumulative
stream sends one event per batch of worker events (whatever had arrived when the client
socket was ready), so a slow reader costs one re-encoding per write, not per token.
"""

from __future__ import annotations

from typing import Any

import msgspec

_ENC = msgspec.json.Encoder()
_OUTPUT_LISTS = ("output_token_logprobs", "output_top_logprobs")
_INPUT_LISTS = ("input_token_logprobs", "input_top_logprobs")  # sent once: O(prompt) per event otherwise


def prompt_only(data: dict[str, Any]) -> dict[str, Any]:
    """The answer to max_new_tokens 0: the token the workers computed is dropped."""
    meta = {k: v for k, v in (data.get("meta_info") or {}).items() if k not in _OUTPUT_LISTS}
    meta["completion_tokens"] = 0
    meta["finish_reason"] = {"type": "length"}
    return {**data, "text": "", "output_ids": [], "meta_info": meta}


def sse_event(data: dict[str, Any]) -> bytes:
    return b"data: " + _ENC.encode(data) + b"\n\n"


class CumulativeEvents:
    """Worker delta events in, cumulative client events out."""

    def __init__(self) -> None:
        self._text: list[str] = []
        self._ids: list[int] = []
        self._lists: dict[str, list[Any]] = {}
        self._meta: dict[str, Any] = {}
        self._once: dict[str, Any] = {}

    def add(self, data: dict[str, Any]) -> None:
        self._text.append(data.get("text") or "")
        self._ids.extend(data.get("output_ids") or [])
        meta = data.get("meta_info") or {}
        for key in _OUTPUT_LISTS:
            if key in meta:
                self._lists.setdefault(key, []).extend(meta[key] or [])
        for k, v in meta.items():
            if k in _INPUT_LISTS:
                self._once[k] = v
            elif k not in _OUTPUT_LISTS:
                self._meta[k] = v

    def event(self) -> bytes:
        meta = {**self._meta, **self._lists, **self._once}
        self._once = {}
        return sse_event({"text": "".join(self._text), "output_ids": self._ids, "meta_info": meta})
