"""What a request asks to be constrained by, read from its sampling params (SGLang's keys)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")
MAX_GRAMMAR_CHARS = 64 * 1024  # a spec is compiled per process and cached: bound what one request may ask
JSON_OBJECT_SCHEMA = '{"type": "object"}'  # response_format {"type": "json_object"}, as SGLang maps it


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint; also the compile cache's key."""

    kind: str  # one of GRAMMAR_KINDS
    text: str


def grammar_of(params: Any) -> GrammarSpec | None:
    """The constraint of a SamplingParams record or a sampling_params dict, None when it has none."""
    for kind in GRAMMAR_KINDS:
        text = params.get(kind) if isinstance(params, dict) else getattr(params, kind, None)
        if text is not None:
            return GrammarSpec(kind, text)
    return None


def check_grammar_fields(params: Any) -> None:
    """ValueError naming the key: at most one constraint, a non-empty string of bounded size."""
    given = [k for k in GRAMMAR_KINDS if getattr(params, k, None) is not None]
    if len(given) > 1:
        raise ValueError(f"give at most one of json_schema, regex, ebnf (got {', '.join(given)})")
    for kind in given:
        text = getattr(params, kind)
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{kind} must be a non-empty string")
        if len(text) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"{kind} has {len(text)} characters; at most {MAX_GRAMMAR_CHARS}")
