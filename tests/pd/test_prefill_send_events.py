"""Prefill never hands a chunk's pages to the KV sender before the step that writes their KV
has completed on the device (issue 20).

On a GPU a step that samples nothing (a non-final prompt chunk) returns from the worker as soon
as its kernels are queued, with an event that completes when they have run; NIXL reads the
pages when it posts. Here the fake model worker's steps come back with fake events the test
completes by hand, and a fake sender checks at every post that each page it gets was last
written by a step whose event has completed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from common.scheduler.executor import StepResult, SyncExecutor, WorkerBatch
from common.scheduler.fake_worker import FakeModelWorker
from kv_transfer import AuxRow, KVPoll
from prefill_server.scheduler import PrefillScheduler
from tests.pd.fake_transfer import FakeKVManager, FakeSender
from tests.pd.test_pd_schedulers import PS, Role, _parts, pages, prompt_of, request


class FakeEvent:
    def __init__(self) -> None:
        self.complete = False

    def query(self) -> bool:
        return self.complete

    def synchronize(self) -> None:
        raise AssertionError("the scheduler must never block on a step's event")


@dataclass
class EventWorker:
    """The fake model worker, each step handing back a fresh FakeEvent; remembers which step's
    event guards each KV page."""

    inner: FakeModelWorker
    events: list[FakeEvent] = field(default_factory=list)
    writer_of_page: dict[int, FakeEvent] = field(default_factory=dict)

    @property
    def future_capacity(self) -> int:
        return self.inner.future_capacity

    def run(self, batch: WorkerBatch) -> StepResult:
        result = self.inner.run(batch)
        event = FakeEvent()
        self.events.append(event)
        for slot in batch.out_cache_loc:
            self.writer_of_page[slot // PS] = event
        result.done = event
        return result


class CheckingSender(FakeSender):
    worker: EventWorker

    def send(self, src_page_ids: Sequence[int], is_last: bool, aux: AuxRow | None = None) -> None:
        early = [p for p in src_page_ids if not self.worker.writer_of_page[p].complete]
        assert not early, f"pages {early} posted before the step writing their KV completed"
        super().send(src_page_ids, is_last, aux)


class CheckingKVManager(FakeKVManager):
    def __init__(self, worker: EventWorker) -> None:
        super().__init__(page_size=PS)
        self.event_worker = worker

    def create_sender(self, rid: str, room: int) -> FakeSender:
        sender = CheckingSender(rid, room)
        sender.worker = self.event_worker
        self.senders[rid] = sender
        return sender


def make_prefill_with_events() -> tuple[Role, EventWorker]:
    config, kv, inner = _parts(128, overlap=False, decode=False, radix=True, chunked_prefill_size=8)
    worker = EventWorker(inner)
    role = Role(None, inner, CheckingKVManager(worker))  # type: ignore[arg-type]
    role.scheduler = PrefillScheduler(config, SyncExecutor(worker), kv, future_capacity=128, output=role.collect,
                                      transfer=role.transfer)  # type: ignore[arg-type]
    return role, worker


def test_prefill_posts_each_chunk_only_after_its_forward_completion_event() -> None:
    p, worker = make_prefill_with_events()
    prompt = prompt_of(30)  # 4 chunks of 8 tokens: 2, 2, 2 whole pages, then the last 2 (partial)
    p.scheduler.add_request(request("a", prompt, 4))
    sender = p.transfer.senders["a"]
    sender.ready(pages(30))
    p.iterate()  # -> waiting, then the first chunk's step
    assert len(worker.events) == 1 and not sender.sends
    p.iterate(2)  # two more chunks computed; none of their events has completed
    assert len(worker.events) == 3 and not sender.sends, "posted before any forward completed"

    worker.events[1].complete = True  # out of order: chunk 2 done, chunk 1 not
    p.iterate()
    assert not sender.sends, "chunk 2 posted ahead of chunk 1"
    worker.events[0].complete = True
    p.scheduler.poll_transfers()
    assert [len(s.pages) for s in sender.sends] == [2, 2]  # chunks 1 and 2, in order
    assert len(worker.events) == 4  # the last chunk ran (it samples the first token)
    worker.events[2].complete = True
    p.scheduler.poll_transfers()
    assert len(sender.sends) == 3 and p.scheduler.inflight  # waiting on the last chunk's event
    worker.events[3].complete = True
    p.scheduler.poll_transfers()
    assert [s.is_last for s in sender.sends] == [False, False, False, True]
    assert len(set(sender.pages_sent)) == len(sender.pages_sent) == pages(30)

    sender.state = KVPoll.Success
    p.iterate()
    assert p.final("a").finish_reason.type == "length"
    assert p.pages_in_use == 0
    p.scheduler.kv.check_integrity()


def test_prefill_drops_queued_posts_of_an_aborted_request() -> None:
    p, worker = make_prefill_with_events()
    p.scheduler.add_request(request("a", prompt_of(30), 4))
    sender = p.transfer.senders["a"]
    sender.ready(pages(30))
    p.iterate(2)
    assert p.scheduler.abort("a", "client left")
    for event in worker.events:
        event.complete = True
    p.iterate(2)
    assert not sender.sends and sender.aborted == "client left"
    assert p.pages_in_use == 0
    p.scheduler.kv.check_integrity()
