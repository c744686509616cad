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
    prompt_logprob_start: int = -1  # >= 0: prompt logprobs from this position (computed by prefill)
    incremental: bool = True  # /generate stream: deltas (else SGLang's cumulative events)
    echo_text: str | None = None  # /v1/completions echo: the prompt as the client sees it
    session_id: str | None = None  # header x-session-id, else the OpenAI `user` field: decode affinity

    @property
    def max_new_tokens(self) -> int:
        return int(self.sampling_params.get("max_new_tokens", 128))

    @property
    def local_prefill_allowed(self) -> bool:
        """May be prefilled on decode alone (prompt logprobs come only from a prefill instance)."""
        return self.prompt_logprob_start < 0 and not self.prompt_only

    @property
    def prompt_only(self) -> bool:
        """The client asked for no new token (e.g. prompt logprobs only): workers compute one, the
        router drops it (a PD pair always hands decode a first token)."""
        return self.max_new_tokens == 0

    @property
    def worker_stream(self) -> bool:
        return self.stream and not self.prompt_only

    def worker_body(self, rid: str, bootstrap: Bootstrap | None, *, stream: bool) -> bytes:
        """The /generate request (docs/generate_api.md) sent to a worker."""
        sampling = self.sampling_params
        if self.prompt_only:
            sampling = {**sampling, "max_new_tokens": 1}
        body: dict[str, Any] = {
            "input_ids": self.input_ids,
            "sampling_params": sampling,
            "stream": stream,
            "rid": rid,
        }
        if stream:
            body["incremental_stream"] = True  # the router builds cumulative events itself
        if self.return_logprob:
            body["return_logprob"] = True
            body["top_logprobs_num"] = self.top_logprobs_num
            if self.prompt_logprob_start >= 0:
                body["logprob_start_len"] = self.prompt_logprob_start
        if self.extra:
            body.update(self.extra)
        if bootstrap is not None:
            body["bootstrap_host"] = bootstrap.host
            body["bootstrap_port"] = bootstrap.port
            body["bootstrap_room"] = bootstrap.room
        return msgspec.json.encode(body)
