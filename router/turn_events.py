"""A session's next turn waits (bounded) for the KV event of the turn before it.

Decode publishes a finished turn's pages before its last tokens leave, but the event still
crosses a socket and the router's event loop: a client that sends turn N+1 the instant turn N
ends can be routed before the router's index (router/kv_index.py) holds turn N, and is then
prefilled again. So when a turn ends the router notes the chain hash of the last whole page
that turn left in decode's cache (prompt + output, less the last token, which has no KV yet);
the session's next turn waits up to --kv-event-wait seconds for that hash to appear in the
decode's index before a pair is chosen. Owned by the Dispatcher; on the event loop.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

MAX_PENDING = 100_000


@dataclass(frozen=True)
class PendingTurn:
    decode_url: str
    page_hash: int  # the last whole page the finished turn left in that decode's cache


class PendingTurns:
    """session key -> the KV event its last turn is owed; least recently used dropped past the cap."""

    def __init__(self, max_pending: int = MAX_PENDING) -> None:
        self.max_pending = max_pending
        self._pending: OrderedDict[str, PendingTurn] = OrderedDict()

    def ended(self, session: str, turn: PendingTurn) -> None:
        self._pending[session] = turn
        self._pending.move_to_end(session)
        while len(self._pending) > self.max_pending:
            self._pending.popitem(last=False)

    def take(self, session: str) -> PendingTurn | None:
        return self._pending.pop(session, None)

    def __len__(self) -> int:
        return len(self._pending)
