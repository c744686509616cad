"""Client body -> GenerationPlan: validation, chat template, tokenization, param mapping.

    /v1/completions       prompt (str | [ids] | [str] | [[ids]], one prompt only)
    /v1/chat/completions  messages (system/developer/user/assistant, text content)
    /generate             SGLang-native: text | input_ids, sampling_params, ...

Everything a worker could reject for the request's own sake is rejected here
with an OpenAI-shaped 400, so nothing reaches a worker for a bad request.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from common.grammar.spec import JSON_OBJECT_SCHEMA
from common.sampling_params import SamplingParams
from kv_transfer.aux_format import MAX_TOP_LOGPROBS
from router.errors import ApiError, bad_request
from router.fields import get_bool, get_float, get_int, get_stop, get_str, get_token_ids
from router.model_info import ModelInfo
from router.native_request import parse_generate
from router.openai_types import ChatCompletionRequest, CompletionRequest, check_types
from router.plan import GenerationPlan

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant"})
SGLANG_EXTRAS = ("top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids", "skip_special_tokens")


class RequestParser:
    """Stateless apart from the (read-only) model info; one per router."""

    def __init__(self, model: ModelInfo, default_max_tokens_cap: int, incremental_default: bool = False,
                 allow_priority: bool = False, *, max_chat_messages: int = 2048,
                 max_prompt_logprob_entries: int = 100_000) -> None:
        self.model = model
        self.cap = default_max_tokens_cap
        self.incremental_default = incremental_default
        self.allow_priority = allow_priority
        self.max_messages = max_chat_messages
        self.max_prompt_logprobs = max_prompt_logprob_entries

    def completion(self, body: dict[str, Any]) -> GenerationPlan:
        model = self._model(body)
        prompt = body.get("prompt")
        ids = self._prompt_ids(prompt)
        echo = get_bool(body, "echo")
        if get_int(body, "best_of", 1, lo=1) != 1:
            raise bad_request("'best_of' > 1 is not supported", "best_of")
        if get_str(body, "suffix"):
            raise bad_request("'suffix' is not supported", "suffix")
        logprobs = get_int(body, "logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
        params = self._sampling(body, ids, get_int(body, "max_tokens", None, lo=0))
        check_types(body, CompletionRequest)
        plan = self._plan("completion", model, ids, params, body, logprobs, "completion")
        if not echo:
            return plan
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if logprobs is not None:
            check_prompt_logprobs(len(ids), 0, logprobs, self.max_prompt_logprobs, "logprobs")
        text = prompt if isinstance(prompt, str) else self.model.tokenizer.decode(ids)
        # echo + logprobs: the prompt tokens' logprobs too, computed where the prompt is (prefill)
        return dataclasses.replace(plan, echo_text=text, prompt_logprob_start=0 if logprobs is not None else -1)

    def chat(self, body: dict[str, Any]) -> GenerationPlan:
        model = self._model(body)
        for unsupported in ("tools", "functions", "tool_choice", "function_call", "audio", "prediction"):
            if body.get(unsupported) not in (None, [], "none"):
                raise bad_request(f"'{unsupported}' is not supported", unsupported)
        ids = self.model.apply_chat_template(self._messages(body.get("messages")))
        self._check_prompt_len(ids, "messages")
        max_tokens = get_int(body, "max_completion_tokens", None, lo=1)
        if max_tokens is None:
            max_tokens = get_int(body, "max_tokens", None, lo=1)
        logprobs = None
        top = get_int(body, "top_logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
        if get_bool(body, "logprobs"):
            logprobs = top or 0
        elif top:
            raise bad_request("'top_logprobs' requires 'logprobs': true", "top_logprobs")
        params = self._sampling(body, ids, max_tokens)
        check_types(body, ChatCompletionRequest)
        return self._plan("chat", model, ids, params, body, logprobs, "chat")

    def generate(self, body: dict[str, Any]) -> GenerationPlan:
        plan = parse_generate(self.model, body, incremental_default=self.incremental_default,
                              allow_priority=self.allow_priority)
        if plan.prompt_logprob_start >= 0:
            check_prompt_logprobs(len(plan.input_ids), plan.prompt_logprob_start, plan.top_logprobs_num,
                                  self.max_prompt_logprobs, "logprob_start_len")
        return plan

    # -- helpers -------------------------------------------------------------------------------

    def _model(self, body: dict[str, Any]) -> str:
        name = get_str(body, "model")
        if name is not None and name not in (self.model.name, self.model.path):
            raise ApiError(404, f"model {name!r} does not exist; this router serves {self.model.name!r}",
                           param="model", code="model_not_found")
        if get_int(body, "n", 1) != 1:
            raise bad_request("only n=1 is supported", "n")
        if body.get("cache_salt") is not None:
            raise bad_request("'cache_salt' is not supported: the prefix cache is shared by all clients of "
                              "this server", "cache_salt")
        return self.model.name

    def _prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            ids = self.model.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
            raise bad_request("batched prompts are not supported; send one prompt per request", "prompt")
        elif isinstance(prompt, list):
            self._check_prompt_len(prompt, "prompt")  # before a pass over every element
            ids = get_token_ids(prompt, "prompt", self.model.vocab_size)
        elif prompt is None:
            raise bad_request("'prompt' is required", "prompt")
        else:
            raise bad_request("'prompt' must be a string or a list of token ids", "prompt")
        self._check_prompt_len(ids, "prompt")
        return ids

    def _messages(self, messages: Any) -> list[dict[str, str]]:
        if not isinstance(messages, list) or not messages:
            raise bad_request("'messages' must be a non-empty array", "messages")
        if len(messages) > self.max_messages:
            raise bad_request(f"'messages' has {len(messages)} entries; the limit is {self.max_messages} "
                              "(--max-chat-messages)", "messages")
        out = []
        for i, m in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(m, dict):
                raise bad_request(f"{where} must be an object", where)
            role = m.get("role")
            if not isinstance(role, str) or role not in CHAT_ROLES:
                raise bad_request(f"{where}.role must be one of {sorted(CHAT_ROLES)}, got {role!r}", f"{where}.role")
            out.append({"role": str(role), "content": _text_content(m.get("content"), f"{where}.content")})
        return out

    def _check_prompt_len(self, ids: list[Any], param: str) -> None:
        if not ids:
            raise bad_request("the prompt is empty", param)
        ctx = self.model.context_length
        if len(ids) >= ctx:
            raise bad_request(
                f"the prompt has {len(ids)} tokens; this model's maximum context length is {ctx} tokens "
                "(and at least one must be left for the completion)", param)

    def _check_total_len(self, ids: list[int], max_new: int, param: str) -> None:
        ctx = self.model.context_length
        if len(ids) + max_new > ctx:
            raise bad_request(
                f"this model's maximum context length is {ctx} tokens; you requested {len(ids) + max_new} "
                f"({len(ids)} in the prompt, {max_new} for the completion)", param)

    def _sampling(self, body: dict[str, Any], ids: list[int], max_tokens: int | None) -> dict[str, Any]:
        if max_tokens is None:
            max_tokens = min(self.model.context_length - len(ids), self.cap)
        self._check_total_len(ids, max_tokens, "max_tokens")
        sp: dict[str, Any] = {"max_new_tokens": max_tokens}
        for name in ("temperature", "top_p", "frequency_penalty", "presence_penalty", "min_p", "repetition_penalty"):
            v = get_float(body, name)
            if v is not None:
                sp[name] = v
        for name in ("seed", "top_k"):
            v = get_int(body, name)
            if v is not None:
                sp[name] = v
        stop = get_stop(body)
        if stop:
            sp["stop"] = stop
        for name in ("ignore_eos", "skip_special_tokens"):
            if body.get(name) is not None:
                sp[name] = get_bool(body, name)
        if body.get("stop_token_ids") is not None:
            sp["stop_token_ids"] = get_token_ids(body["stop_token_ids"], "stop_token_ids", self.model.vocab_size,
                                                 allow_empty=True)
        if body.get("logit_bias"):
            raise bad_request("'logit_bias' is not supported", "logit_bias")
        sp.update(response_format(body.get("response_format")))
        return self._validated(sp)

    def _validated(self, sp: dict[str, Any]) -> dict[str, Any]:
        try:
            params = SamplingParams.from_dict(sp)
            params.validate(self.model.vocab_size)
        except ValueError as e:
            raise bad_request(str(e), "sampling_params") from None
        return msgspec.to_builtins(params)  # type: ignore[no-any-return]

    def _plan(self, api: Any, model: str, ids: list[int], sp: dict[str, Any], body: dict[str, Any],
              logprobs: int | None, mode: Any) -> GenerationPlan:
        stream = get_bool(body, "stream")
        opts = body.get("stream_options")
        if opts is not None and not isinstance(opts, dict):
            raise bad_request("'stream_options' must be an object", "stream_options")
        include_usage = get_bool(opts or {}, "include_usage")
        return GenerationPlan(
            api, model, ids, sp, stream, include_usage=stream and include_usage,
            return_logprob=logprobs is not None, top_logprobs_num=logprobs or 0,
            logprobs_mode=mode if logprobs is not None else "none",
        )


def response_format(fmt: Any) -> dict[str, str]:
    """OpenAI's response_format -> the sampling param that constrains the output (SGLang's mapping:
    json_object is the schema {"type": "object"}); the schema itself is checked by the router's
    GrammarChecker."""
    if fmt is None:
        return {}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": JSON_OBJECT_SCHEMA}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema", spec.get("schema_")) if isinstance(spec, dict) else None
        if not isinstance(schema, dict | bool):
            raise bad_request("response_format.json_schema.schema must be a JSON schema object",
                              "response_format.json_schema.schema")
        return {"json_schema": msgspec.json.encode(schema).decode()}
    raise bad_request("response_format.type must be one of text, json_object, json_schema", "response_format.type")


def _text_content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"{where}: only text parts {{'type': 'text', 'text': str}} are supported", where)
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"{where} must be a string or a list of text parts", where)


def check_prompt_logprobs(n_prompt: int, start: int, top: int, limit: int, param: str) -> None:
    """400 when a request asks for more prompt logprob entries than --max-prompt-logprob-entries:
    each is built, sent and formatted per prompt token, in Python, on every hop."""
    entries = (n_prompt - start) * max(1, top)
    if entries > limit:
        raise bad_request(f"prompt logprobs for {n_prompt - start} tokens x {max(1, top)} alternatives are "
                          f"{entries} entries; the limit is {limit} (--max-prompt-logprob-entries)", param)


def safe_rid(rid: str) -> bool:
    return 0 < len(rid) <= 128 and rid.isascii() and rid.isprintable()
