"""The records the scheduler owns at its edges: what it emits and what a PD request carries.

    TokenOut      new tokens of one request (the scheduler's output sink receives lists of them)
    FinishReason  why a request ended ("stop" | "length" | "abort", with an HTTP status for errors)
    BootstrapInfo where a PD request's KV peer is (prefill's bootstrap host/port, the shared room)

They are msgspec Structs because the server layer sends them unchanged over its ZMQ channel
(common/server/io_struct.py re-exports them); the scheduler itself never imports the server.
"""

from __future__ import annotations

import msgspec


class BootstrapInfo(msgspec.Struct, frozen=True, array_like=True):
    """Where decode finds the prefill that computes this request (PD mode only)."""

    host: str
    port: int
    room: int


class FinishReason(msgspec.Struct, frozen=True, array_like=True):
    type: str  # "stop" | "length" | "abort"
    matched_token: int | None = None  # the stop/eos token id
    message: str | None = None  # for "abort": why
    status_code: int = 200  # HTTP status for errors (400 bad input, 500 internal, 503, 504 timeout)
    err_type: str | None = None  # error type shown to the client (e.g. "kv_transfer_failed")


class TokenOut(msgspec.Struct, frozen=True, array_like=True):
    """New tokens of one request since the previous TokenOut of that request."""

    rid: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    new_token_logprobs: list[float] | None = None
    new_top_logprobs: list[list[tuple[int, float]]] | None = None
    # prompt logprobs (requests with logprob_start_len >= 0), once, with the first TokenOut after them
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[int, float]]] | None = None
