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


class LoadReport(msgspec.Struct, kw_only=True):
    """GET /get_load: what the router's load_aware policy and admission read, from one stats round trip.

    queued: requests not running yet (waiting; prefill's bootstrap queue; decode's prealloc and
    transfer queues); queued_tokens: prompt tokens still to compute; kv_free_tokens: free plus
    evictable cached KV slots; prompt_tokens_total / step_seconds_total (engine steps' wall time,
    forwards included): the measured prefill rate."""

    num_running_reqs: int
    num_queued_reqs: int
    num_queued_tokens: int
    kv_free_tokens: int
    kv_total_tokens: int
    max_running_requests: int
    prompt_tokens_total: int
    step_seconds_total: float

    @classmethod
    def from_stats(cls, s: dict[str, float]) -> LoadReport:
        page = s.get("page_size", 1.0)
        queued = sum(s.get(k, 0.0) for k in ("num_waiting_reqs", "num_bootstrap_queue_reqs",
                                               "num_prealloc_queue_reqs", "num_transfer_queue_reqs"))
        return cls(
            num_running_reqs=int(s.get("num_running_reqs", 0)),
            num_queued_reqs=int(queued),
            num_queued_tokens=int(s.get("num_waiting_tokens", 0)),
            kv_free_tokens=int((s.get("kv_pages_free", 0) + s.get("kv_pages_cached", 0)) * page),
            kv_total_tokens=int(s.get("kv_pages_total", 0) * page),
            max_running_requests=int(s.get("max_running_requests", 0)),
            prompt_tokens_total=int(s.get("prompt_tokens_total", 0)),
            step_seconds_total=float(s.get("step_seconds_total", 0.0)),
        )
