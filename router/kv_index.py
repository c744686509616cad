"""The router's exact view of each worker's prefix cache, fed by the workers' KV events.

A worker with a radix cache publishes what its tree holds (common/cache/kv_events.py) on
the ZMQ endpoint its /server_info names. `KVIndexes` keeps one SUB subscription per such
worker and one `WorkerKVIndex` (the set of page chain hashes it holds). An index is used
only while it is in sync: it starts out of sync, is rebuilt from a KVSnapshot, then
follows KVEventBatches; a seq gap (messages dropped) or a new epoch (the worker
restarted) puts it out of sync until the next snapshot. So a restarted or re-registered
worker is never judged by what its previous life held. With a cluster secret the
subscription is a CURVE client of the worker's CURVE server (common/cluster_secret.py).

Owned by the router app: `sync()` (from the health loop) follows the registry, the
dispatcher asks `cached_tokens()`. Everything runs on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from common.cache.kv_events import KVEventMessage, KVSnapshot, PromptHashes
from common.cluster_secret import CurveKeys
from common.zmq_curve import CurveSecurity
from router.worker import Worker

logger = logging.getLogger("router.kv_index")
STALE_AFTER_S = 5.0  # no snapshot for this long (they come every second): the endpoint is not, or no longer, the worker's


class WorkerKVIndex:
    def __init__(self) -> None:
        self.epoch: int | None = None
        self.seq = 0
        self.page_size = 0
        self.hashes: set[int] = set()
        self.synced = False
        self.snapshot_at = float("-inf")  # monotonic time of the last snapshot
        self.resyncs = 0  # times it fell out of sync (gap or restart) and waited for a snapshot

    def fresh(self, now: float) -> bool:
        """In sync, and the publisher's periodic snapshots still arrive (it is alive, at this endpoint)."""
        return self.synced and now - self.snapshot_at < STALE_AFTER_S

    def apply(self, msg: KVEventMessage, now: float) -> None:
        if isinstance(msg, KVSnapshot):
            self.epoch, self.seq, self.page_size = msg.epoch, msg.seq, msg.page_size
            self.hashes = set(msg.hashes)
            self.synced = True
            self.snapshot_at = now
            return
        if not self.synced or msg.seq <= self.seq and msg.epoch == self.epoch:
            return  # waiting for a snapshot, or already in the snapshot
        if msg.epoch != self.epoch or msg.seq != self.seq + 1:
            self.synced = False
            self.resyncs += 1
            self.hashes = set()
            return
        self.seq = msg.seq
        if msg.cleared:
            self.hashes.clear()
        self.hashes.difference_update(msg.removed)
        self.hashes.update(msg.stored)

    def cached_pages(self, prompt: PromptHashes) -> int:
        n = 0
        while n < prompt.num_pages and prompt[n] in self.hashes:
            n += 1
        return n


@dataclass
class _Subscription:
    endpoint: str
    index: WorkerKVIndex
    task: asyncio.Task[None]
    since: float  # monotonic time of subscribing
    applied: asyncio.Event  # set (and replaced) after each message applied: wakes wait_for_page


MAX_SNAPSHOT_BYTES = 256 << 20  # 32M pages' hashes


class KVIndexes:
    def __init__(self, events_keys: CurveKeys | None = None) -> None:
        self._ctx = zmq.asyncio.Context.instance()
        self._security = CurveSecurity(self._ctx, events_keys, MAX_SNAPSHOT_BYTES)  # a CURVE client with keys
        self._subs: dict[str, _Subscription] = {}
        self._decoder = msgspec.msgpack.Decoder(KVEventMessage)

    def sync(self, workers: Iterable[Worker]) -> None:
        """Subscribe to every worker that publishes KV events, at its current endpoint; drop the rest."""
        want = {w.url: w.cache_info.kv_events_endpoint for w in workers
                if not w.removed and w.cache_info is not None and w.cache_info.kv_events_endpoint}
        for url, sub in list(self._subs.items()):
            if want.get(url) != sub.endpoint:
                sub.task.cancel()
                del self._subs[url]
        for url, endpoint in want.items():
            if url not in self._subs and endpoint is not None:
                index = WorkerKVIndex()
                task = asyncio.ensure_future(self._follow(url, endpoint, index))
                self._subs[url] = _Subscription(endpoint, index, task, time.monotonic(), asyncio.Event())

    def describe(self, url: str) -> dict[str, object] | None:
        """For GET /workers: None when the worker publishes no KV events (or is not followed yet)."""
        sub = self._subs.get(url)
        if sub is None:
            return None
        i = sub.index
        return {"endpoint": sub.endpoint, "synced": i.fresh(time.monotonic()), "seq": i.seq, "pages": len(i.hashes),
                "resyncs": i.resyncs}

    def stale(self, url: str) -> bool:
        """No snapshot for STALE_AFTER_S (e.g. the worker restarted on another port before it was seen
        down): drops the subscription; the caller should learn the worker's endpoint again."""
        sub = self._subs.get(url)
        now = time.monotonic()
        if sub is None or now - max(sub.since, sub.index.snapshot_at) < STALE_AFTER_S:
            return False
        sub.task.cancel()
        del self._subs[url]
        return True

    def index(self, url: str) -> WorkerKVIndex | None:
        """The worker's index while it is in sync and fresh, else None (then nothing is known)."""
        sub = self._subs.get(url)
        return sub.index if sub is not None and sub.index.fresh(time.monotonic()) else None

    def cached_tokens(self, worker: Worker, input_ids: Sequence[int], memo: dict[int, PromptHashes]) -> int | None:
        """Leading prompt tokens `worker` holds in its cache (whole pages); None when not known.
        `memo` shares the prompt's hashes (per page size) across the workers of one pick."""
        index = self.index(worker.url)
        if index is None or index.page_size <= 0:
            return None
        ps = index.page_size
        if ps not in memo:
            memo[ps] = PromptHashes(input_ids, ps)
        return index.cached_pages(memo[ps]) * ps

    def last_page_hash(self, url: str, tokens: Sequence[int]) -> int | None:
        """Chain hash of the last whole page of `tokens` in the worker's page size; None when the
        worker is not followed (or not in sync) or `tokens` fill no page."""
        index = self.index(url)
        if index is None or index.page_size <= 0 or len(tokens) < index.page_size:
            return None
        prompt = PromptHashes(tokens, index.page_size)
        return prompt[prompt.num_pages - 1]

    async def wait_for_page(self, url: str, page_hash: int, timeout_s: float) -> bool:
        """Until the worker's index holds `page_hash` (True), at most timeout_s (False); at once
        when the worker is not followed or its index is out of sync (nothing to wait for)."""
        deadline = time.monotonic() + timeout_s
        while True:
            sub = self._subs.get(url)
            index = self.index(url)
            if sub is None or index is None:
                return False
            if page_hash in index.hashes:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(sub.applied.wait(), left)
            except TimeoutError:
                return False

    async def _follow(self, url: str, endpoint: str, index: WorkerKVIndex) -> None:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._security.connect(sock)
        sock.connect(endpoint)
        logger.info("following KV events of %s at %s", url, endpoint)
        try:
            while True:
                raw = await sock.recv()
                try:
                    index.apply(self._decoder.decode(raw), time.monotonic())
                except msgspec.DecodeError as e:
                    logger.warning("bad KV event from %s: %s", url, e)
                sub = self._subs.get(url)
                if sub is not None and sub.index is index:
                    done, sub.applied = sub.applied, asyncio.Event()
                    done.set()
        finally:
            sock.close(0)

    async def close(self) -> None:
        tasks = [s.task for s in self._subs.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._subs.clear()
