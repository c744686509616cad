"""/generate body -> GenerationPlan, with the instances' own type (common/server/generate_request.py).

The router validates with the same msgspec type and the same field policy as every instance
(honour, ignore at any value, or 400 naming the field), so nothing a worker would refuse
reaches one. Client-sent bootstrap fields are refused: the router sets them.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from common.sampling_request import parse_sampling_params
from common.server.generate_request import GenerateRequestBody
from kv_transfer.aux_format import MAX_TOP_LOGPROBS
from router.errors import bad_request
from router.fields import get_token_ids
from router.model_info import ModelInfo
from router.plan import GenerationPlan

_PATH = re.compile(r"at `\$\.([A-Za-z_][A-Za-z0-9_.]*)")
_UNKNOWN = re.compile(r"unknown field `([^`]+)`")
_FIELD = re.compile(r"^([A-Za-z_][A-Za-z0-9_.]*)=")


def decode_generate(body: dict[str, Any]) -> GenerateRequestBody:
    """A decoded JSON object -> the typed body, or 400 naming the field."""
    try:
        req = msgspec.convert(body, GenerateRequestBody, strict=True)
    except msgspec.ValidationError as e:
        text = str(e)
        unknown = _UNKNOWN.search(text)
        if unknown is not None:
            name = unknown.group(1)
            hint = " (set by the router)" if name.startswith("bootstrap_") else ""
            raise bad_request(f"unknown field {name}{hint}", name) from None
        where = _PATH.search(text)
        raise bad_request(f"invalid request: {text}", where.group(1) if where else None) from None
    try:
        req.check_supported()
    except ValueError as e:
        field = _FIELD.match(str(e))
        raise bad_request(str(e), field.group(1) if field else None) from None
    for name in ("bootstrap_host", "bootstrap_port", "bootstrap_room"):
        if getattr(req, name) is not None:
            raise bad_request(f"'{name}' is set by the router, not by clients", name)
    return req


def parse_generate(model: ModelInfo, body: dict[str, Any], *, incremental_default: bool,
                   allow_priority: bool = False) -> GenerationPlan:
    ctx = model.context_length
    raw_ids = body.get("input_ids")
    if isinstance(raw_ids, list) and len(raw_ids) >= ctx:  # before any pass over the elements
        raise bad_request(f"the prompt has {len(raw_ids)} tokens; this model's maximum context length is {ctx} "
                          "tokens (and at least one must be left for the completion)", "input_ids")
    req = decode_generate(body)
    if (req.text is None) == (req.input_ids is None):
        raise bad_request("exactly one of 'text' and 'input_ids' is required", "text")
    if req.text is not None:
        ids = model.encode(req.text)
        where = "text"
    else:
        assert req.input_ids is not None
        ids = get_token_ids(req.input_ids, "input_ids", model.vocab_size)
        where = "input_ids"
    if not ids:
        raise bad_request("the prompt is empty", where)
    if len(ids) >= ctx:
        raise bad_request(f"the prompt has {len(ids)} tokens; this model's maximum context length is {ctx} tokens "
                          "(and at least one must be left for the completion)", where)
    try:
        params = parse_sampling_params(req.sampling_params)
        params.validate(model.vocab_size)
    except ValueError as e:
        raise bad_request(str(e), "sampling_params") from None
    if len(ids) + params.max_new_tokens > ctx:
        raise bad_request(f"this model's maximum context length is {ctx} tokens; you requested "
                          f"{len(ids) + params.max_new_tokens} ({len(ids)} in the prompt, {params.max_new_tokens} "
                          "for the completion)", "sampling_params.max_new_tokens")
    top = req.num_top_logprobs
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad_request(f"'top_logprobs_num' must be in [0, {MAX_TOP_LOGPROBS}], got {top}", "top_logprobs_num")
    if top and not req.wants_logprob:
        raise bad_request("'top_logprobs_num' needs 'return_logprob': true", "top_logprobs_num")
    start = req.prompt_logprob_start
    if not -1 <= start < len(ids):
        raise bad_request(f"'logprob_start_len' must be -1 or in [0, {len(ids)}) (the prompt's tokens), got {start}",
                          "logprob_start_len")
    if req.rid is not None and not (0 < len(req.rid) <= 128 and req.rid.isascii() and req.rid.isprintable()):
        raise bad_request("'rid' must be 1-128 printable ASCII characters", "rid")
    priority = req.priority
    if priority is not None and not allow_priority:
        raise bad_request("'priority' is not accepted from clients (the operator enables it with "
                          "--enable-priority-scheduling)", "priority")
    if priority is not None and not -(2**31) <= priority < 2**31:
        raise bad_request(f"'priority' must fit in 32 bits, got {priority}", "priority")
    extra: dict[str, Any] = {}
    if priority is not None:
        extra["priority"] = priority
    if req.return_text_in_logprobs:
        extra["return_text_in_logprobs"] = True
    incremental = req.incremental_stream if req.incremental_stream is not None else incremental_default
    return GenerationPlan(
        "generate", model.name, ids, msgspec.to_builtins(params), req.stream,
        return_logprob=req.wants_logprob, top_logprobs_num=top, extra=extra or None, client_rid=req.rid,
        prompt_logprob_start=start, incremental=incremental,
    )
