"""Messages between an instance's frontend process and its engine process (ZMQ ipc://).

    frontend --(EngineRequest: GenerateReq | AbortReq | StatsReq)--> engine
    frontend <--(EngineReply: BatchTokenOut | StatsResp)----------- engine

Every message is a tagged msgspec.Struct (array_like for compactness) encoded with
msgpack; decode with `ENGINE_REQUEST_DECODER` / `ENGINE_REPLY_DECODER`.
The engine sends token ids only; the frontend detokenizes (incremental, UTF-8
safe), applies stop strings and streams to its HTTP client.
"""

from __future__ import annotations

import msgspec

from common.sampling_params import SamplingParams

PROTOCOL_VERSION = 1


class BootstrapInfo(msgspec.Struct, frozen=True, array_like=True):
    """Where decode finds the prefill that computes this request (PD mode only)."""

    host: str
    port: int
    room: int


class GenerateReq(msgspec.Struct, frozen=True, array_like=True, tag="gen"):
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    bootstrap: BootstrapInfo | None = None
    priority: int = 0


class AbortReq(msgspec.Struct, frozen=True, array_like=True, tag="abort"):
    rid: str
    reason: str = "aborted by client"


class StatsReq(msgspec.Struct, frozen=True, array_like=True, tag="stats"):
    """Also the health probe: the engine answers with StatsResp(seq=seq)."""

    seq: int


EngineRequest = GenerateReq | AbortReq | StatsReq


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


class BatchTokenOut(msgspec.Struct, frozen=True, array_like=True, tag="tokens"):
    items: list[TokenOut]


class StatsResp(msgspec.Struct, frozen=True, array_like=True, tag="stats_resp"):
    seq: int
    stats: dict[str, float]  # gauge/counter name -> value (queues, pools, new_token_ratio, ...)
    unhealthy: str | None = None  # why the engine cannot serve though it answers (e.g. KV transfer down)


EngineReply = BatchTokenOut | StatsResp

ENGINE_REQUEST_DECODER = msgspec.msgpack.Decoder(EngineRequest)
ENGINE_REPLY_DECODER = msgspec.msgpack.Decoder(EngineReply)
ENCODER = msgspec.msgpack.Encoder()
