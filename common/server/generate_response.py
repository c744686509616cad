"""Types of the native /generate answers (docs/generate_api.md), for the OpenAPI document.

The frontend builds these bodies in common/server/req_state.py (Chunk.to_json); the router
passes them through or re-shapes them (router/native_response.py). Logprob entries are
[logprob, token id] (plus the token's text with return_text_in_logprobs); a prompt's first
token has logprob null.
"""

from __future__ import annotations

from typing import Any

import msgspec

LogprobEntry = list[float | int | str | None]


class FinishReasonInfo(msgspec.Struct, kw_only=True):
    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None
    message: str | None = None


class GenerateMetaInfo(msgspec.Struct, kw_only=True):
    id: str
    finish_reason: FinishReasonInfo | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    output_token_logprobs: list[LogprobEntry] | None = None
    output_top_logprobs: list[list[LogprobEntry]] | None = None
    input_token_logprobs: list[LogprobEntry] | None = None
    input_top_logprobs: list[list[LogprobEntry] | None] | None = None


class GenerateResponse(msgspec.Struct, kw_only=True):
    """Non-streaming answer, and each `data:` event of a stream (cumulative or delta)."""

    text: str
    output_ids: list[int]
    meta_info: GenerateMetaInfo


class ErrorDetail(msgspec.Struct, kw_only=True):
    message: str
    type: str
    code: int | str | None = None
    param: str | None = None


class ErrorResponse(msgspec.Struct, kw_only=True):
    error: ErrorDetail


class AbortResponse(msgspec.Struct, kw_only=True):
    rid: str
    aborted: bool


class HealthResponse(msgspec.Struct, kw_only=True):
    status: str
    engine: dict[str, Any] | None = None
    check: str | None = None
