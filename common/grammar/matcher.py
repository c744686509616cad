"""One request's grammar state. Owned by the scheduler thread: it accepts every token the request
gets (sampled here, or replayed: decode's first token from the aux row) and fills the request's
row of a step's bitmask. Kept on the Req across retraction (the tokens it accepted stay the
request's output), so a resumed request continues where its grammar was."""

from __future__ import annotations

from typing import Any

from common.grammar.spec import GrammarSpec


class RequestGrammar:
    def __init__(self, spec: GrammarSpec, compiled: Any) -> None:
        import xgrammar as xgr

        self.spec = spec
        self._matcher = xgr.GrammarMatcher(compiled)
        self.num_accepted = 0

    def accept(self, token: int) -> bool:
        """Advance by token; False when the grammar does not allow it (the state is unchanged)."""
        ok = bool(self._matcher.accept_token(token))
        self.num_accepted += ok
        return ok

    def fill(self, bitmask: Any, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (int32 words, bit i of word w = token 32w+i).
        A terminated grammar allows everything: its request has finished and the token is dropped
        (an overlap step built before the end was known still samples that row)."""
        if self._matcher.is_terminated():
            bitmask[row] = -1
            return
        self._matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def is_terminated(self) -> bool:
        """The grammar accepted its end (a stop token): nothing may follow."""
        return bool(self._matcher.is_terminated())
