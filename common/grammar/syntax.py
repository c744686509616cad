"""Parse a GrammarSpec with xgrammar: the check that names what is wrong with a schema, regex or
grammar. Importing xgrammar imports torch (tvm_ffi does), so only engine processes and the
router's checker process (router/grammar_check.py) call this."""

from __future__ import annotations

import json
import re
from typing import Any

from common.grammar.spec import GrammarSpec

# Compact JSON: no whitespace between tokens beyond ", " and ": ". With any whitespace allowed a
# small model can loop on blanks until max_tokens (SGLang's --constrained-json-disable-any-whitespace).
JSON_ANY_WHITESPACE = False


_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[time] file.cc:line: "


# xgrammar 0.2.8 writes the characters of a string with minLength / maxLength as [^"\\\r\n], which
# lets raw control characters (U+0000-U+001F) into the string: not JSON (json.loads refuses it).
# Its unbounded strings exclude them; bounded ones get the same class here.
_LOOSE_STRING_CHAR = r'(([^\"\\\r\n]))'
_JSON_STRING_CHAR = r'(([^\0-\x1f\"\\\r\n]))'


class InvalidGrammar(ValueError):
    """The spec does not parse; the message names the kind and the problem (safe for a client)."""


def parse_grammar(spec: GrammarSpec) -> Any:
    """xgrammar.Grammar of spec, or InvalidGrammar."""
    import xgrammar as xgr

    try:
        if spec.kind == "json_schema":
            schema = json.loads(spec.text)
            if not isinstance(schema, dict | bool):
                raise InvalidGrammar("json_schema must be a JSON object")
            grammar = xgr.Grammar.from_json_schema(spec.text, any_whitespace=JSON_ANY_WHITESPACE, strict_mode=True)
            text = str(grammar)
            fixed = text.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR)
            return grammar if fixed == text else xgr.Grammar.from_ebnf(fixed)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.text)
        if spec.kind == "ebnf":
            return xgr.Grammar.from_ebnf(spec.text)
    except InvalidGrammar:
        raise
    except json.JSONDecodeError as e:
        raise InvalidGrammar(f"json_schema is not valid JSON: {e}") from None
    except Exception as e:  # xgrammar raises RuntimeError / ValueError with the parser's message
        raise InvalidGrammar(f"invalid {spec.kind}: {_first_line(e)}") from None
    raise InvalidGrammar(f"unknown grammar kind {spec.kind!r}")


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    msg = _SOURCE_PREFIX.sub("", text[0]) if text else type(e).__name__
    return msg if len(msg) <= 300 else msg[:297] + "..."


def grammar_problem(kind: str, text: str) -> str | None:
    """What is wrong with a spec (None: it parses). Picklable entry point for a checker process."""
    try:
        parse_grammar(GrammarSpec(kind, text))
    except InvalidGrammar as e:
        return str(e)
    return None
