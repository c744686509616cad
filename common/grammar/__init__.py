"""Structured output: grammars (JSON schema, regex, EBNF) that constrain sampling.

    spec.py     GrammarSpec (kind, text) from sampling params; pure checks, no xgrammar
    syntax.py   parse a spec with xgrammar (imports torch: engine side, or the router's checker process)
    backend.py  GrammarBackend: one per engine process, compiles each spec once on its own thread
    matcher.py  RequestGrammar: one request's matcher (accept, fill its row of the bitmask)
    mask.py     StepGrammarMask: the bitmask of one step's constrained rows, applied to the logits
"""

from common.grammar.spec import GRAMMAR_KINDS, GrammarSpec, grammar_of

__all__ = ["GRAMMAR_KINDS", "GrammarSpec", "grammar_of"]
