"""The OpenAI request and response types the router serves (the OpenAPI schemas come from these).

Requests: the documented fields of /v1/completions and /v1/chat/completions, plus SGLang's
sampling extras. router/openai_request.py checks each body against its type first (wrong
types -> 400 naming the field), then applies the rules: honoured, or refused by name when a
value asks for what this server lacks (n > 1, best_of > 1, suffix, logit_bias, tools, ...).
Unknown fields are ignored, as vLLM does (the official client sends extra_body fields as is).
"""

from __future__ import annotations

from typing import Any

import msgspec

from router.errors import bad_request

Stop = str | list[str] | None


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = None


class SamplingFields(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: Stop = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # SGLang / vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    stop_token_ids: list[int] | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[str | int | list[int]]  # a text, token ids, or a batch of one of either
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    response_format: dict[str, Any] | None = None  # as on chat (router/openai_request.py response_format)


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatChoiceMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | None


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ChatChoiceMessage
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: str
    created: int
    owned_by: str
    root: str | None = None
    max_model_len: int | None = None


class ModelList(msgspec.Struct, kw_only=True):
    object: str
    data: list[ModelCard]


def check_types(body: dict[str, Any], kind: type[msgspec.Struct]) -> None:
    """400 naming the field whose JSON type does not match the request type."""
    try:
        msgspec.convert(body, kind, strict=True)
    except msgspec.ValidationError as e:
        text = str(e)
        where = text.rsplit("at `$.", 1)[1].rstrip("`") if "at `$." in text else None
        param = where.split("[", 1)[0].split(".", 1)[0] if where else None
        raise bad_request(f"invalid request: {text}", param) from None
