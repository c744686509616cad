"""A validated request, ready to fan out: what every worker of the pair receives.

Built by router.openai_request from a client body; consumed by the dispatcher.
Immutable, so a retry re-encodes the same plan with a new room.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import msgspec

Api = Literal["completion", "chat", "generate"]


class Bootstrap(msgspec.Struct, frozen=True):
    host: str
    port: int
    room: int


@dataclass(frozen=True)
class GenerationPlan:
    api: Api
    model: str
    input_ids: list[int]
    sampling_params: dict[str, Any]  # SGLang names, validated by SamplingParams
    stream: bool
    include_usage: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprobs_mode: Literal["none", "completion", "chat"] = "none"
    extra: dict[str, Any] | None = None  # /generate passthrough fields (e.g. priority)
    client_rid: str | None = None  # /generate body "rid" (X-Request-Id header wins)

    @property
    def max_new_tokens(self) -> int:
        return int(self.sampling_params.get("max_new_tokens", 128))

    def worker_body(self, rid: str, bootstrap: Bootstrap | None, *, stream: bool) -> bytes:
        """The /generate request (docs/generate_api.md) sent to a worker."""
        body: dict[str, Any] = {
            "input_ids": self.input_ids,
            "sampling_params": self.sampling_params,
            "stream": stream,
            "rid": rid,
        }
        if self.return_logprob:
            body["return_logprob"] = True
            body["top_logprobs_num"] = self.top_logprobs_num
        if self.extra:
            body.update(self.extra)
        if bootstrap is not None:
            body["bootstrap_host"] = bootstrap.host
            body["bootstrap_port"] = bootstrap.port
            body["bootstrap_room"] = bootstrap.room
        return msgspec.json.encode(body)
