"""Worker events (docs/generate_api.md) -> OpenAI response bodies and SSE chunks.

One ResponseFormatter per request. Worker `text`/`output_ids` are deltas in a
stream; logprob lists may be deltas or cumulative (both are accepted: a list
longer than the delta is treated as cumulative and its new tail is taken).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from router.model_info import ModelInfo
from router.native_response import prompt_only
from router.plan import GenerationPlan

_ENC = msgspec.json.Encoder()
FINISH_MAP = {"stop": "stop", "length": "length"}


def sse(obj: Any) -> bytes:
    return b"data: " + _ENC.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class ResponseFormatter:
    def __init__(self, plan: GenerationPlan, rid: str, model: ModelInfo) -> None:
        self.plan = plan
        self.model = model
        self.chat = plan.api == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + rid
        self.object = "chat.completion" if self.chat else "text_completion"
        self.created = int(time.time())
        self.n_tokens = 0
        self.n_logprobs = 0
        self.text_offset = 0
        self.meta: dict[str, Any] = {}
        self._sent_role = False

    # -- non-streaming -------------------------------------------------------------------------

    def full(self, ev: dict[str, Any]) -> bytes:
        if self.plan.prompt_only:
            ev = prompt_only(ev)
        meta = self.meta = ev.get("meta_info") or {}
        text = ev.get("text") or ""
        ids = ev.get("output_ids") or []
        self.n_tokens = len(ids)
        echo = self._echo(meta)
        logprobs = self._logprobs(ids, meta)
        if echo is not None and logprobs is not None:
            logprobs = _join_logprobs(echo[1], logprobs)
        choice: dict[str, Any] = {"index": 0, "finish_reason": self._finish(meta), "logprobs": logprobs}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text if echo is None else echo[0] + text
        return _ENC.encode({"id": self.id, "object": self.object, "created": self.created, "model": self.plan.model,
                            "choices": [choice], "usage": self.usage()})

    # -- streaming -----------------------------------------------------------------------------

    def chunk(self, ev: dict[str, Any]) -> bytes:
        if self.plan.prompt_only:
            ev = prompt_only(ev)
        meta = ev.get("meta_info") or {}
        if meta:
            self.meta = meta
        text = ev.get("text") or ""
        ids = ev.get("output_ids") or []
        self.n_tokens += len(ids)
        finish = self._finish(meta)
        echo = None if self._sent_role else self._echo(meta)
        if not text and not ids and finish is None and self._sent_role:
            return b""
        logprobs = self._logprobs(ids, meta)
        if echo is not None:
            text = echo[0] + text
            if logprobs is not None:
                logprobs = _join_logprobs(echo[1], logprobs)
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": logprobs}
        if self.chat:
            delta: dict[str, Any] = {"content": text}
            if not self._sent_role:
                delta["role"] = "assistant"
                self._sent_role = True
            choice["delta"] = delta
        else:
            self._sent_role = True
            choice["text"] = text
        out: dict[str, Any] = {"id": self.id, "object": self.object + (".chunk" if self.chat else ""),
                               "created": self.created, "model": self.plan.model, "choices": [choice]}
        if self.plan.include_usage:
            out["usage"] = None
        return sse(out)

    def tail(self) -> bytes:
        """After the last worker event: the usage chunk (if asked for) and [DONE]."""
        if not self.plan.include_usage:
            return SSE_DONE
        out = {"id": self.id, "object": self.object + (".chunk" if self.chat else ""), "created": self.created,
               "model": self.plan.model, "choices": [], "usage": self.usage()}
        return sse(out) + SSE_DONE

    # -- shared --------------------------------------------------------------------------------

    def usage(self) -> dict[str, Any]:
        meta = self.meta
        prompt = int(meta.get("prompt_tokens") or len(self.plan.input_ids))
        completion = int(meta.get("completion_tokens") or self.n_tokens)
        out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                               "total_tokens": prompt + completion}
        cached = meta.get("cached_tokens")
        if isinstance(cached, int):
            out["prompt_tokens_details"] = {"cached_tokens": cached}
        return out

    @staticmethod
    def _finish(meta: dict[str, Any]) -> str | None:
        fr = meta.get("finish_reason")
        if fr is None:
            return None
        kind = fr.get("type") if isinstance(fr, dict) else fr
        return FINISH_MAP.get(str(kind), "stop")

    def _logprobs(self, ids: list[int], meta: dict[str, Any]) -> dict[str, Any] | None:
        if self.plan.logprobs_mode == "none":
            return None
        chosen = self._new_tail(meta.get("output_token_logprobs") or [], len(ids))
        tops = self._new_tail(meta.get("output_top_logprobs") or [], len(ids)) if self.plan.top_logprobs_num else []
        self.n_logprobs += len(chosen)
        tok = self.model.token_text
        if self.plan.logprobs_mode == "chat":
            content = []
            for i, item in enumerate(chosen):
                t = tok(int(item[1]))
                top = [{"token": tok(int(x[1])), "logprob": float(x[0]), "bytes": list(tok(int(x[1])).encode())}
                       for x in (tops[i] if i < len(tops) else [])]
                content.append({"token": t, "logprob": float(item[0]), "bytes": list(t.encode()), "top_logprobs": top})
            return {"content": content}
        tokens = [tok(int(item[1])) for item in chosen]
        offsets = []
        for t in tokens:
            offsets.append(self.text_offset)
            self.text_offset += len(t)
        top_out = [{tok(int(x[1])): float(x[0]) for x in pos} for pos in tops] if tops else None
        return {"tokens": tokens, "token_logprobs": [float(item[0]) for item in chosen],
                "top_logprobs": top_out, "text_offset": offsets}

    def _echo(self, meta: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
        """echo: (the prompt text, the prompt tokens' completion-style logprobs); first token: null."""
        if self.plan.echo_text is None:
            return None
        tok = self.model.token_text
        entries = meta.get("input_token_logprobs") or []
        tops = meta.get("input_top_logprobs") or []
        tokens = [tok(int(e[1])) for e in entries] or [tok(t) for t in self.plan.input_ids]
        offsets = []
        for t in tokens:
            offsets.append(self.text_offset)
            self.text_offset += len(t)
        top_out: list[dict[str, float] | None] | None = None
        if self.plan.top_logprobs_num:
            top_out = [{tok(int(x[1])): float(x[0]) for x in pos} if pos else None for pos in tops]
        logprobs = {"tokens": tokens, "token_logprobs": [None if e[0] is None else float(e[0]) for e in entries],
                    "top_logprobs": top_out, "text_offset": offsets}
        return self.plan.echo_text, logprobs

    def _new_tail(self, items: list[Any], n_delta: int) -> list[Any]:
        """Delta list (len == n_delta) or cumulative (len == tokens so far): return the new part."""
        if len(items) > n_delta and len(items) >= self.n_logprobs + n_delta:
            return items[self.n_logprobs:self.n_logprobs + n_delta]
        return items


def _join_logprobs(prompt: dict[str, Any], output: dict[str, Any]) -> dict[str, Any]:
    """Completion logprobs of the echoed prompt followed by those of the new tokens."""
    tops = None
    if prompt["top_logprobs"] is not None or output["top_logprobs"] is not None:
        tops = (prompt["top_logprobs"] or [None] * len(prompt["tokens"])) + (output["top_logprobs"] or [])
    return {"tokens": prompt["tokens"] + output["tokens"],
            "token_logprobs": prompt["token_logprobs"] + output["token_logprobs"],
            "top_logprobs": tops, "text_offset": prompt["text_offset"] + output["text_offset"]}
