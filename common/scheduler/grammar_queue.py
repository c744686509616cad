"""Requests waiting for their grammar to compile (SGLang's grammar_queue), owned by the Scheduler.

A constrained request enters here instead of the role's queue; once its compile is done it gets
its matcher and goes on (ready), or ends with the compile's error (failed). The wait is bounded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from common.grammar.backend import GrammarBackend
from common.grammar.spec import grammar_of
from common.grammar.syntax import InvalidGrammar
from common.optional_packages import MissingPackage
from common.scheduler.req import Req

COMPILE_TIMEOUT_S = 60.0


@dataclass
class GrammarOutcome:
    req: Req
    error: str | None = None  # None: req.grammar is set
    status_code: int = 400


class GrammarQueue:
    def __init__(self, backend: GrammarBackend, timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        self.backend = backend
        self.timeout_s = timeout_s
        self._waiting: dict[Req, float] = {}  # -> deadline

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, req: Req) -> bool:
        return req in self._waiting

    def add(self, req: Req) -> None:
        spec = grammar_of(req.sampling_params)
        assert spec is not None, f"not a constrained request: {req}"
        req.grammar_future = self.backend.get(spec)
        self._waiting[req] = time.monotonic() + self.timeout_s

    def remove(self, req: Req) -> None:
        self._waiting.pop(req, None)

    def pop_done(self) -> list[GrammarOutcome]:
        """The requests whose compile ended (or timed out), in arrival order."""
        out: list[GrammarOutcome] = []
        now = time.monotonic()
        for req, deadline in list(self._waiting.items()):
            fut = req.grammar_future
            assert fut is not None
            if not fut.done():
                if now > deadline:
                    del self._waiting[req]
                    out.append(GrammarOutcome(req, f"grammar compile did not finish within {self.timeout_s:g} s", 503))
                continue
            del self._waiting[req]
            spec = grammar_of(req.sampling_params)
            assert spec is not None
            try:
                req.grammar = self.backend.matcher(spec, fut.result())
                problem = _replay_prompt_tail(req)
                if problem is not None:
                    req.grammar = None
                    out.append(GrammarOutcome(req, problem))
                    continue
            except InvalidGrammar as e:
                out.append(GrammarOutcome(req, str(e)))
                continue
            except MissingPackage as e:  # this install cannot serve it: 501 naming the package
                out.append(GrammarOutcome(req, str(e), e.status_code))
                continue
            except Exception as e:  # the compiler itself failed: not the client's fault
                out.append(GrammarOutcome(req, f"grammar compile failed: {e}", 500))
                continue
            out.append(GrammarOutcome(req))
        return out


def _replay_prompt_tail(req: Req) -> str | None:
    """A migrated request: its prompt ends with the output generated so far, which its grammar
    accepts before the first new token (None), or the problem."""
    k = req.sampling_params.grammar_prefix_len
    if k == 0:
        return None
    assert req.grammar is not None
    if k >= len(req.origin_input_ids):
        return f"grammar_prefix_len {k} must be less than the prompt's {len(req.origin_input_ids)} tokens"
    for i, token in enumerate(req.origin_input_ids[-k:]):
        if not req.grammar.accept(token):
            return f"prompt token {len(req.origin_input_ids) - k + i} ({token}) is not allowed by the request's {req.grammar.spec.kind}"
    return None
