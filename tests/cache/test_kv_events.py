"""KV events: the radix cache names every page it holds by chain hash; the publisher's batches and
snapshots, sent over real ZMQ, rebuild that exact set in the router's index, which falls out of
sync on a gap or a restart (new epoch) and trusts nothing until the next snapshot."""

from __future__ import annotations

import random
import secrets
import time

import msgspec
import pytest
import zmq

from common.cache import PageAllocator, RadixCache
from common.cache.kv_events import KVEventBatch, KVEventMessage, KVSnapshot, PromptHashes, page_hashes
from common.cache.radix_node import TreeNode
from common.server.kv_event_publisher import KVEventPublisher
from router.kv_index import STALE_AFTER_S, WorkerKVIndex

PAGE = 4


def tree_hashes(radix: RadixCache) -> set[int]:
    """Chain hashes of every page the tree holds, recomputed from its paths."""
    out: set[int] = set()
    stack: list[tuple[TreeNode, list[int]]] = [(radix.root, [])]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            full = path + child.key.tolist()
            out.update(page_hashes(full, PAGE)[len(path) // PAGE:])
            stack.append((child, full))
    return out


def cache_with_publisher(num_pages: int) -> tuple[RadixCache, KVEventPublisher]:
    pub = KVEventPublisher("127.0.0.1", 0, PAGE, snapshot_interval_s=3600)
    return RadixCache(PageAllocator(num_pages, PAGE), PAGE, events=pub), pub


def insert(radix: RadixCache, tokens: list[int]) -> None:
    """A finished request hands its whole pages to the tree (its duplicates freed, as the scheduler does)."""
    aligned = len(tokens) - len(tokens) % PAGE
    radix.evict(max(0, aligned // PAGE - radix.allocator.num_free))
    slots = radix.allocator.alloc_slots(0, None, aligned)
    assert slots is not None
    already = radix.insert(tokens[:aligned], slots)
    radix.allocator.free_slots(slots[:already])


def test_held_set_follows_inserts_splits_evictions_and_reset() -> None:
    radix, pub = cache_with_publisher(num_pages=40)
    rng = random.Random(3)
    prefixes = [[rng.randrange(100) for _ in range(12)] for _ in range(3)]
    try:
        for _ in range(60):
            seq = rng.choice(prefixes)[: rng.choice([4, 8, 12])] + [rng.randrange(100) for _ in range(rng.randrange(9))]
            insert(radix, seq)
            radix.check_integrity()
            assert pub.held == tree_hashes(radix)
            assert set(page_hashes(seq, PAGE)) <= pub.held
        assert radix.num_evicted_pages > 0, "the pool was meant to be too small to keep everything"
        radix.reset()
        assert pub.held == set()
    finally:
        pub.close()


def test_index_rebuilt_from_zmq_equals_the_tree() -> None:
    radix, pub = cache_with_publisher(num_pages=40)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(f"tcp://127.0.0.1:{pub.port}")
    decoder = msgspec.msgpack.Decoder(KVEventMessage)
    index = WorkerKVIndex()
    rng = random.Random(5)
    try:
        # a subscriber misses what is sent before it joins: keep sending snapshots until one lands
        deadline = time.monotonic() + 10
        clock = 0.0
        while not index.synced:
            assert time.monotonic() < deadline, "no snapshot reached the subscriber"
            clock += 7200  # past the snapshot interval: flush sends one
            pub.flush(now=clock)
            if sub.poll(100):
                index.apply(decoder.decode(sub.recv()), time.monotonic())
        for _ in range(40):
            insert(radix, [rng.randrange(50) for _ in range(rng.randrange(4, 20))])
            pub.flush(now=clock)  # batches only: no snapshot is due
            while sub.poll(0 if index.seq == pub.seq else 5000):
                index.apply(decoder.decode(sub.recv()), time.monotonic())
            assert index.seq == pub.seq and index.synced
            assert index.hashes == tree_hashes(radix)
    finally:
        sub.close(0)
        pub.close()


def test_gap_and_restart_wait_for_a_snapshot() -> None:
    index = WorkerKVIndex()
    index.apply(KVEventBatch(1, 1, [10], []), 0.0)
    assert not index.synced, "a batch without a snapshot is not trusted"
    index.apply(KVSnapshot(1, 1, PAGE, [10]), 0.0)
    index.apply(KVEventBatch(1, 2, [11], [10]), 0.0)
    assert index.synced and index.hashes == {11}
    index.apply(KVEventBatch(1, 4, [12], []), 0.0)  # seq 3 was lost
    assert not index.synced and index.hashes == set() and index.resyncs == 1
    index.apply(KVSnapshot(1, 4, PAGE, [11, 12]), 1.0)
    assert index.synced and index.hashes == {11, 12}
    index.apply(KVEventBatch(2, 1, [13], []), 1.0)  # the worker restarted: new epoch
    assert not index.synced and index.resyncs == 2
    index.apply(KVSnapshot(2, 1, PAGE, [13]), 2.0)
    assert index.fresh(2.0) and not index.fresh(2.0 + STALE_AFTER_S), "silence past the bound is not trusted"


@pytest.mark.parametrize("cached_pages", [0, 2, 5])
def test_cached_pages_counts_leading_hashes(cached_pages: int) -> None:
    prompt = list(range(22))
    hashes = page_hashes(prompt, PAGE)
    assert len(hashes) == 5  # the partial last page is not named
    index = WorkerKVIndex()
    index.apply(KVSnapshot(1, 0, PAGE, hashes[:cached_pages] + page_hashes([99] * 8, PAGE)), 0.0)
    lazy = PromptHashes(prompt, PAGE)
    assert index.cached_pages(lazy) == cached_pages
    assert [lazy[i] for i in range(5)] == hashes
    other = [7, *prompt[1:]]  # same tokens after the first: every chain hash differs
    assert index.cached_pages(PromptHashes(other, PAGE)) == 0


def test_with_a_cluster_secret_only_the_cluster_subscribes() -> None:
    """CURVE: a subscriber holding the cluster's client key gets the events; a plain subscriber and
    one keyed by another secret get nothing while the first receives every snapshot."""
    from common.cluster_secret import ClusterSecret
    from common.zmq_curve import CurveSecurity

    ctx = zmq.Context.instance()
    secret, other = ClusterSecret(secrets.token_bytes(32)), ClusterSecret(secrets.token_bytes(32))
    pub = KVEventPublisher("127.0.0.1", 0, PAGE, secret=secret, snapshot_interval_s=3600)
    subs = []
    for keys in (secret.router_keys().events, None, other.router_keys().events):
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        CurveSecurity(ctx, keys, 1 << 20).connect(sock)
        sock.connect(f"tcp://127.0.0.1:{pub.port}")
        subs.append(sock)
    good, plain, wrong = subs
    decoder = msgspec.msgpack.Decoder(KVEventMessage)
    try:
        received, clock, deadline = 0, 0.0, time.monotonic() + 10
        while received < 5:
            assert time.monotonic() < deadline, f"the cluster's subscriber got {received} snapshots"
            clock += 7200
            pub.flush(now=clock)
            if good.poll(100):
                assert isinstance(decoder.decode(good.recv()), KVSnapshot)
                received += 1
        assert not plain.poll(0) and not wrong.poll(0), "a subscriber without the cluster's key got events"
    finally:
        for sock in subs:
            sock.close(0)
        pub.close()
