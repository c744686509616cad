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
from common.scheduler.messages import BootstrapInfo, FinishReason, TokenOut

PROTOCOL_VERSION = 1


class GenerateReq(msgspec.Struct, frozen=True, array_like=True, tag="gen"):
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    bootstrap: BootstrapInfo | None = None
    priority: int = 0
    logprob_start_len: int = -1  # >= 0: also the logprobs of prompt tokens from this position on


class AbortReq(msgspec.Struct, frozen=True, array_like=True, tag="abort"):
    rid: str
    reason: str = "aborted by client"


class StatsReq(msgspec.Struct, frozen=True, array_like=True, tag="stats"):
    """Also the health probe: the engine answers with StatsResp(seq=seq)."""

    seq: int


EngineRequest = GenerateReq | AbortReq | StatsReq


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

__all__ = [
    "AbortReq", "BatchTokenOut", "BootstrapInfo", "EngineReply", "EngineRequest", "FinishReason", "GenerateReq",
    "StatsReq", "StatsResp", "TokenOut",
]
