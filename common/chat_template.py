"""Render a checkpoint's chat template as transformers' apply_chat_template(tokenize=False) does,
without importing transformers (~1 s of CPU per process start).

Same environment: jinja2's ImmutableSandboxedEnvironment (templates are untrusted code) with
trim_blocks and lstrip_blocks, the loopcontrols extension, a `{% generation %}` block that
renders its body, a `tojson` filter that does not escape HTML, and the globals raise_exception,
strftime_now, dict and a namespace that refuses underscore names. Same inputs: messages with
None-valued keys dropped and reasoning fields aliased, everything the template sees rebuilt
from plain JSON types, the tokenizer's named special tokens (bos_token, eos_token, ...) as
variables, and caller kwargs over them. tests/server/test_tokenizer_parity.py holds it equal
to transformers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """The template refused the conversation (raise_exception) or could not be chosen."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it just renders."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


class _TemplateDict:
    """`dict(...)` in templates, without dict's class attributes."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's namespace(), refusing underscore-prefixed attributes (no path to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja's own signature trick)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_TemplateDict(), namespace=_TemplateNamespace)
    return env.from_string(source)


def plain(value: Any) -> Any:
    """What a template may see: JSON scalars, dicts, lists and tuples; anything else becomes '<TypeName>'."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    return f"<{type(value).__name__}>"


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


class ChatTemplate:
    """A checkpoint's chat template(s): one source, or named sources ("default", "tool_use", ...).

    Owned by the tokenizer that loaded it; immutable; render() is safe from any thread.
    """

    def __init__(self, source: str | dict[str, str], special_tokens: dict[str, str]) -> None:
        self.source = source
        self._special_tokens = dict(special_tokens)

    def pick(self, tools: list[Any] | None) -> str:
        """The source transformers' get_chat_template would pick."""
        if isinstance(self.source, str):
            return self.source
        if tools is not None and "tool_use" in self.source:
            return self.source["tool_use"]
        if "default" in self.source:
            return self.source["default"]
        raise ChatTemplateError(f"several chat templates and no default: {sorted(self.source)}")

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = False,
               tools: list[dict[str, Any]] | None = None, documents: list[dict[str, Any]] | None = None,
               **kwargs: Any) -> str:
        """The prompt text; raises ChatTemplateError for what the template refuses (raise_exception)."""
        if not messages:
            raise ChatTemplateError("cannot apply the chat template to an empty conversation")
        chat = []
        for m in messages:
            if not isinstance(m, dict):
                raise ChatTemplateError(f"chat messages must be dicts, got {type(m).__name__}")
            chat.append(_alias_reasoning(plain({k: v for k, v in m.items() if v is not None})))
        if tools is not None and not all(isinstance(t, dict) for t in tools):
            raise ChatTemplateError("tools must be JSON schemas (dicts)")
        if documents is not None and not all(isinstance(d, dict) for d in documents):
            raise ChatTemplateError("documents must be dicts with 'title' and 'text'")
        variables = plain({**self._special_tokens, **kwargs})
        template = compile_template(self.pick(tools))
        try:
            return template.render(messages=chat, tools=plain(tools), documents=plain(documents),
                                   add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(str(e)) from e
