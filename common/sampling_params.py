"""Per-request sampling parameters (SGLang names), validated once at the edge.

Owned by whoever receives the request (router, frontend, offline Engine); the
scheduler and sampler only read them. `from_dict` rejects unknown keys and
out-of-range values with a ValueError whose message is safe to show a client.
"""

from __future__ import annotations

from typing import Any

import msgspec

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256  # the detokenizer scans every stop string at each token
MAX_STOP_TOKEN_IDS = 1024


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False  # keep a matched stop string in the output text
    # structured output (at most one; common/grammar): the text of a JSON schema, a regex, an EBNF grammar
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    # the prompt's last N tokens were generated under that constraint (a request the router migrated
    # to a new pair after a decode failure): they are replayed into the matcher before sampling
    grammar_prefix_len: int = 0

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """SGLang's sampling_params object -> validated params (common/sampling_request.py)."""
        from common.sampling_request import parse_sampling_params

        return parse_sampling_params(d)

    def validate(self, vocab_size: int | None = None) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        if isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 0:
            bad(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not (0.0 <= self.temperature <= 100.0):
            bad(f"temperature must be in [0, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            bad(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not (0.0 < self.repetition_penalty <= 10.0):
            bad(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if self.seed is not None and not (-(2**63) <= self.seed < 2**63):
            bad("seed must fit in 64 bits")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in self.stop):
            bad("stop strings must be non-empty")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            bad(f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            bad(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids")
        from common.grammar.spec import check_grammar_fields

        check_grammar_fields(self)
        if self.grammar_prefix_len < 0:
            bad(f"grammar_prefix_len must be >= 0, got {self.grammar_prefix_len}")
        if self.grammar_prefix_len and self.json_schema is None and self.regex is None and self.ebnf is None:
            bad("grammar_prefix_len needs json_schema, regex or ebnf")
        if vocab_size is not None:
            for t in self.stop_token_ids:
                if not (0 <= t < vocab_size):
                    bad(f"stop_token_ids entry {t} is outside the vocabulary [0, {vocab_size})")
