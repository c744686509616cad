"""What the router needs from the model directory: tokenizer, chat template, context length.

Loaded once at startup (`ModelInfo.load`); read-only afterwards. The router
tokenizes and applies the chat template so both roles see identical input ids;
text comes back from the workers, the router never re-detokenizes output.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from common.model.context_length import (
    ContextLengthError,
    model_context_length,
    read_config_json,
    resolve_context_length,
)
from common.tokenizer_loading import load_tokenizer
from router.errors import ApiError


@dataclass(frozen=True)
class ModelInfo:
    name: str  # the model id in /v1/models and responses
    path: str
    context_length: int
    vocab_size: int
    tokenizer: Any  # FastTokenizer, or transformers' for tokenizer classes it does not cover
    max_prompt_chars: int = 0  # 0: 32 x context_length; longer prompts are refused before tokenizing

    @classmethod
    def load(cls, model_path: str, served_name: str | None = None, context_length: int | None = None,
             max_prompt_chars: int | None = None) -> ModelInfo:
        tokenizer = load_tokenizer(model_path)
        config = read_config_json(model_path)
        if model_context_length(config) is None and context_length is None:
            limit = getattr(tokenizer, "model_max_length", None)
            context_length = limit if isinstance(limit, int) and 0 < limit < 10_000_000 else None
        try:
            ctx = resolve_context_length(config, context_length)
        except ContextLengthError:
            raise ValueError(f"cannot find the context length of {model_path}; pass --context-length") from None
        # the id clients see: the directory's name, not its path (the path is accepted as an alias)
        name = served_name or Path(model_path).name or model_path
        return cls(name, model_path, int(ctx), len(tokenizer), tokenizer, max_prompt_chars or 32 * int(ctx))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def check_chars(self, n_chars: int, param: str) -> None:
        """400 for a prompt too long to fit in any tokenization, before the tokenizer sees it."""
        limit = self.max_prompt_chars or 32 * self.context_length
        if n_chars > limit:
            raise ApiError(400, f"the prompt has {n_chars} characters; the limit is {limit} (--max-prompt-chars)",
                           param=param)

    def encode(self, text: str) -> list[int]:
        self.check_chars(len(text), "prompt")
        try:
            return list(_encode(self.tokenizer, text))
        except UnicodeEncodeError:
            raise ApiError(400, "prompt is not valid Unicode (lone surrogate?)", param="prompt") from None

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        if not self.has_chat_template:
            raise ApiError(400, f"model {self.name} has no chat template; use /v1/completions", param="messages")
        self.check_chars(sum(len(m["content"]) for m in messages), "messages")
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja raise_exception() in templates reports bad conversations
            raise ApiError(400, f"chat template rejected the messages: {str(e)[:300]}", param="messages") from None
        if not isinstance(text, str):
            raise ApiError(500, "chat template did not render a string", type="internal_error")
        self.check_chars(len(text), "messages")  # the rendered prompt: empty messages still render
        # The template already holds any BOS; adding special tokens again would double it.
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        except UnicodeEncodeError:
            raise ApiError(400, "messages are not valid Unicode (lone surrogate?)", param="messages") from None

    def token_text(self, token_id: int) -> str:
        return _token_text(self.tokenizer, token_id)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=True)  # type: ignore[no-any-return]


@lru_cache(maxsize=65536)
def _token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)  # type: ignore[no-any-return]
