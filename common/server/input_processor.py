"""Request validation and tokenization at the frontend: body -> GenerateReq or ApiError(400).

Length policy (documented choice):
- an empty prompt, or a prompt of >= context_length tokens, is rejected (400);
- max_new_tokens > context_length can never be served and is rejected (400);
- otherwise, when prompt + max_new_tokens exceeds the context, max_new_tokens is
  clipped to context_length - prompt_tokens (SGLang's behaviour), so a default
  max_new_tokens never fails a long prompt.
"""

from __future__ import annotations

import ipaddress
import logging
import re
from dataclasses import dataclass
from typing import Any

import msgspec

from common.model.context_length import ContextLengthError, read_config_json, resolve_context_length
from common.sampling_params import SamplingParams
from common.sampling_request import parse_sampling_params
from common.server.io_struct import BootstrapInfo, GenerateReq
from common.server.protocol import MAX_BOOTSTRAP_ROOM, GenerateRequestBody, bad_request
from common.server.server_args import ServerArgs
from kv_transfer.aux_format import MAX_TOP_LOGPROBS

logger = logging.getLogger(__name__)

MAX_RID_LEN = 256
# RFC 1123 host names (underscores tolerated); anything else must parse as an IP address.
_HOSTNAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?")


@dataclass(frozen=True)
class ModelInfo:
    """What the frontend must know about the model to validate requests."""

    context_length: int
    vocab_size: int

    @classmethod
    def resolve(cls, args: ServerArgs, tokenizer: Any, engine_stats: dict[str, float]) -> ModelInfo:
        """Engine's ready stats first (it loaded the model), then flags, then config.json."""
        config = read_config_json(args.model_path)
        context = engine_stats.get("context_length")
        if not context:
            try:
                context = resolve_context_length(read_config_json(args.model_path), args.context_length)
            except ContextLengthError:
                raise RuntimeError(f"cannot tell the context length of {args.model_path}: pass --context-length") from None
        text_config = config.get("text_config") or {}
        vocab = engine_stats.get("vocab_size") or text_config.get("vocab_size") or config.get("vocab_size") or len(tokenizer)
        return cls(context_length=int(context), vocab_size=int(vocab))


class InputProcessor:
    """Turns a decoded /generate body into the engine's GenerateReq. Stateless per call."""

    def __init__(self, tokenizer: Any, info: ModelInfo, args: ServerArgs) -> None:
        self.tokenizer = tokenizer
        self.info = info
        self._pd_mode = args.disaggregation_mode != "null"
        # decode with its prefix cache prefills a request that names no prefill itself (from that cache)
        self._bootstrap_optional = args.is_decode and args.disaggregation_decode_enable_radix_cache
        self.max_prompt_chars = args.max_prompt_chars or 32 * info.context_length
        self.max_prompt_logprobs = args.max_prompt_logprob_entries

    def check_text_len(self, text: str) -> None:
        """400 before tokenizing a prompt that cannot fit (a cheap reject for huge bodies)."""
        if len(text) > self.max_prompt_chars:
            raise bad_request(f"the prompt has {len(text)} characters; the limit is {self.max_prompt_chars} "
                              "(--max-prompt-chars)")

    def process(self, body: GenerateRequestBody, rid: str) -> GenerateReq:
        if not rid or len(rid) > MAX_RID_LEN:
            raise bad_request(f"rid must be 1..{MAX_RID_LEN} characters")
        try:
            params = parse_sampling_params(body.sampling_params)
            params.validate(self.info.vocab_size)
        except ValueError as e:
            raise bad_request(str(e)) from None
        input_ids = self._prompt_ids(body)
        params = self._fit_context(len(input_ids), params)
        if self._pd_mode and params.max_new_tokens == 0:
            raise bad_request("sampling_params.max_new_tokens=0 is not served by a PD instance (the router serves it)")
        top = body.num_top_logprobs
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise bad_request(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
        if top and not body.return_logprob:
            raise bad_request("top_logprobs_num needs return_logprob=true")
        start = body.prompt_logprob_start
        if not -1 <= start < len(input_ids):
            raise bad_request(f"logprob_start_len must be -1 or in [0, {len(input_ids)}) (the prompt's tokens), got {start}")
        entries = (len(input_ids) - start) * max(1, top) if start >= 0 else 0
        if entries > self.max_prompt_logprobs:
            raise bad_request(f"prompt logprobs for {len(input_ids) - start} tokens x {max(1, top)} alternatives are "
                              f"{entries} entries; the limit is {self.max_prompt_logprobs} (--max-prompt-logprob-entries)")
        if not -(2**31) <= body.priority_value < 2**31:
            raise bad_request(f"priority must fit in 32 bits, got {body.priority}")
        return GenerateReq(
            rid=rid,
            input_ids=input_ids,
            sampling_params=params,
            stream=body.stream,
            return_logprob=body.wants_logprob,
            top_logprobs_num=top,
            bootstrap=self._bootstrap(body),
            priority=body.priority_value,
            logprob_start_len=start,
        )

    def _prompt_ids(self, body: GenerateRequestBody) -> list[int]:
        if (body.text is None) == (body.input_ids is None):
            raise bad_request("give exactly one of `text` and `input_ids`")
        if body.text is not None:
            if not body.text:
                raise bad_request("the prompt is empty")
            self.check_text_len(body.text)
            ids: list[int] = list(self.tokenizer.encode(body.text))
        else:
            assert body.input_ids is not None
            ids = body.input_ids
            vocab = self.info.vocab_size
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise bad_request(f"input_ids entry {bad} is outside the vocabulary [0, {vocab})")
        if not ids:
            raise bad_request("the prompt is empty")
        return ids

    def _fit_context(self, prompt_len: int, params: SamplingParams) -> SamplingParams:
        context = self.info.context_length
        if prompt_len >= context:
            raise bad_request(
                f"the prompt has {prompt_len} tokens; the model's context is {context} tokens "
                f"(prompt + output), so at most {context - 1} prompt tokens fit"
            )
        if params.max_new_tokens > context:
            raise bad_request(f"max_new_tokens {params.max_new_tokens} exceeds the context length {context}")
        room = context - prompt_len
        if params.max_new_tokens > room:
            return msgspec.structs.replace(params, max_new_tokens=room)
        return params

    def _bootstrap(self, body: GenerateRequestBody) -> BootstrapInfo | None:
        fields = (body.bootstrap_host, body.bootstrap_port, body.bootstrap_room)
        given = sum(f is not None for f in fields)
        if given == 0:
            if self._pd_mode and not self._bootstrap_optional:
                raise bad_request("bootstrap_host, bootstrap_port and bootstrap_room are required in PD mode")
            return None
        if given != 3:
            raise bad_request("give all of bootstrap_host, bootstrap_port and bootstrap_room, or none")
        assert body.bootstrap_host is not None and body.bootstrap_port is not None
        assert body.bootstrap_room is not None
        if not _valid_host(body.bootstrap_host):
            raise bad_request(f"bootstrap_host must be a host name or an IP address, got {body.bootstrap_host[:100]!r}")
        if not 0 < body.bootstrap_port < 65536:
            raise bad_request(f"bootstrap_port must be 1..65535, got {body.bootstrap_port}")
        if not 0 <= body.bootstrap_room <= MAX_BOOTSTRAP_ROOM:
            raise bad_request(f"bootstrap_room must be in [0, 2^63-1], got {body.bootstrap_room}")
        if not self._pd_mode:
            return None
        return BootstrapInfo(host=body.bootstrap_host, port=body.bootstrap_port, room=body.bootstrap_room)


def _valid_host(host: str) -> bool:
    """A host the KV transfer layer can connect to (a malformed one must never reach it)."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return _HOSTNAME.fullmatch(host) is not None
