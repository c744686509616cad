"""The offline reference for constrained greedy decoding: transformers' full forward at every
step, xgrammar's own matcher (its TokenizerInfo from the transformers tokenizer, not ours) and
bitmask kernel, argmax over the allowed tokens. Shares only the grammar text with the engine."""

from __future__ import annotations

import functools
import json

import torch
import transformers

from common.grammar.spec import GrammarSpec
from common.grammar.syntax import parse_grammar
from tests.engine.reference import hf_model


@functools.lru_cache(maxsize=4)
def _compiler(path: str, vocab_size: int, eos: int) -> object:
    import xgrammar as xgr

    tok = transformers.AutoTokenizer.from_pretrained(path)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size, stop_token_ids=[eos])
    return xgr.GrammarCompiler(info, max_threads=1)


def compile_reference(path: str, kind: str, text: str) -> object:
    model = hf_model(path)
    compiler = _compiler(path, model.config.vocab_size, model.config.eos_token_id)
    # the grammar text is the engine's (compact JSON, the bounded-string fix in syntax.py);
    # tokenizer info, matcher, masking and sampling here are xgrammar's and transformers' own
    return compiler.compile_grammar(parse_grammar(GrammarSpec(kind, text)))  # type: ignore[attr-defined]


def constrained_greedy(path: str, prompt: list[int], kind: str, text: str, max_new_tokens: int) -> list[int]:
    """Greedy tokens under the grammar, up to and including the stop token that ends it."""
    return list(_constrained_greedy(path, tuple(prompt), kind, text, max_new_tokens))


@functools.lru_cache(maxsize=256)
@torch.inference_mode()
def _constrained_greedy(path: str, prompt: tuple[int, ...], kind: str, text: str, max_new_tokens: int) -> tuple[int, ...]:
    import xgrammar as xgr

    model = hf_model(path)
    vocab = model.config.vocab_size
    matcher = xgr.GrammarMatcher(compile_reference(path, kind, text))
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    ids = list(prompt)
    out: list[int] = []
    while len(out) < max_new_tokens and not matcher.is_terminated():
        logits = model(torch.tensor([ids])).logits[0, -1].clone()
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(logits[None], bitmask)
        token = int(logits.argmax())
        assert matcher.accept_token(token)
        out.append(token)
        ids.append(token)
    return tuple(out)


SCHEMA = json.dumps({
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 1, "maximum": 40},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        "box": {"type": "object", "properties": {"w": {"type": "number", "minimum": 0, "maximum": 1}},
                "required": ["w"]},
    },
    "required": ["name", "color", "size", "tags", "box"],
})
REGEX = r"(yes|no|maybe)-[0-9]{2,3}\.(ab|cd)+"
EBNF = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "x" [0-9]'
CONSTRAINTS = {"json_schema": SCHEMA, "regex": REGEX, "ebnf": EBNF}
