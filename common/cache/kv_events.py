"""KV events: what an instance's radix cache holds, as page hashes, for the router (torch-free).

Each whole page of a cached sequence is named by a chain hash: the hash of the page's
token ids and of the hash of the page before it (0 before the first page), so one hash
names the whole prefix ending with that page. The same function runs in the engine
(naming the pages its tree stores and evicts) and in the router (naming a prompt's
pages), so "how much of this prompt does worker W hold" is a count of leading hashes
found in W's set.

Wire (engine -> router, ZMQ PUB/SUB, msgpack of the tagged structs below):
    KVEventBatch  the net change since the previous batch (seq + 1)
    KVSnapshot    every hash held now, as of `seq`; sent on an interval, so a subscriber
                  that joined late, missed a batch (seq gap) or saw a new `epoch` (the
                  instance restarted) rebuilds from the next one instead of trusting stale state.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Protocol

import msgspec

ROOT_HASH = 0


def page_hash(parent: int, tokens: Sequence[int]) -> int:
    data = struct.pack(f"<Q{len(tokens)}I", parent, *tokens)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def page_hashes(tokens: Sequence[int], page_size: int, parent: int = ROOT_HASH) -> list[int]:
    """Chain hashes of the whole pages of `tokens` (a trailing partial page is not named)."""
    out: list[int] = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        parent = page_hash(parent, tokens[start : start + page_size])
        out.append(parent)
    return out


class PromptHashes:
    """A prompt's page chain hashes, computed only as far as they are asked for (a match stops at
    the first page a worker lacks, so a miss costs one hash, not one per page)."""

    def __init__(self, tokens: Sequence[int], page_size: int) -> None:
        self.tokens = tokens
        self.page_size = page_size
        self.num_pages = len(tokens) // page_size
        self._hashes: list[int] = []

    def __getitem__(self, i: int) -> int:
        hashes, ps = self._hashes, self.page_size
        while len(hashes) <= i:
            start = len(hashes) * ps
            hashes.append(page_hash(hashes[-1] if hashes else ROOT_HASH, self.tokens[start : start + ps]))
        return hashes[i]


class KVEventSink(Protocol):
    """Told by the RadixCache which pages (by chain hash) it starts or stops holding."""

    def stored(self, hashes: list[int]) -> None: ...

    def removed(self, hashes: list[int]) -> None: ...

    def cleared(self) -> None: ...


class KVEventBatch(msgspec.Struct, tag=True, frozen=True):
    epoch: int  # random per engine start
    seq: int  # previous batch's seq + 1 (the first batch is 1)
    stored: list[int]
    removed: list[int]
    cleared: bool = False  # everything held before this batch is gone (applied before `stored`)


class KVSnapshot(msgspec.Struct, tag=True, frozen=True):
    epoch: int
    seq: int  # the last batch this snapshot includes
    page_size: int
    hashes: list[int]


KVEventMessage = KVEventBatch | KVSnapshot
