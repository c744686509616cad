"""A fake KV transfer manager for in-process PD scheduler tests (the fake model worker's KV).

The test drives every handle's state by hand (`handle.state = ...`, `fail()`, `complete()`),
so each queue of PrefillScheduler and DecodeScheduler is reached on purpose. A decode
receiver's `complete(prompt, first_token)` plays prefill's WRITEs: it stores the prompt's
tokens in the fake worker's KV slots of the pages decode handed to init(), so decode's
following steps read them exactly as they would read transferred KV.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from common.scheduler.fake_worker import FakeModelWorker
from kv_transfer import AuxRow, FailureCause, KVPoll


class FakeHandle:
    def __init__(self, rid: str, room: int) -> None:
        self.rid = rid
        self.room = room
        self.state = KVPoll.Bootstrapping
        self.failure_reason: str | None = None
        self.failure_cause: FailureCause | None = None
        self.aborted: str | None = None

    def poll(self) -> KVPoll:
        return self.state

    def fail(self, cause: FailureCause, reason: str) -> None:
        if self.state not in (KVPoll.Success, KVPoll.Failed):
            self.state, self.failure_cause, self.failure_reason = KVPoll.Failed, cause, reason

    def abort(self, reason: str = "aborted") -> None:
        self.aborted = reason
        self.fail(FailureCause.ABORTED, reason)


@dataclass
class Send:
    pages: list[int]
    is_last: bool
    aux: AuxRow | None


class FakeSender(FakeHandle):
    def __init__(self, rid: str, room: int) -> None:
        super().__init__(rid, room)
        self.num_dst_pages: int | None = None
        self.skip_pages = 0
        self.sends: list[Send] = []

    def ready(self, num_dst_pages: int, skip_pages: int = 0) -> None:
        """Decode reserved its pages (after the `skip_pages` it holds already)."""
        self.num_dst_pages, self.skip_pages = num_dst_pages, skip_pages
        self.state = KVPoll.WaitingForInput

    def send(self, src_page_ids: Sequence[int], is_last: bool, aux: AuxRow | None = None) -> None:
        assert self.state != KVPoll.Bootstrapping, "send() before decode's pages are known"
        if self.state == KVPoll.Failed:
            return
        self.sends.append(Send(list(src_page_ids), is_last, aux))
        self.state = KVPoll.Transferring

    @property
    def pages_sent(self) -> list[int]:
        return [p for s in self.sends for p in s.pages]


class FakeReceiver(FakeHandle):
    def __init__(self, rid: str, room: int, worker: FakeModelWorker | None, page_size: int) -> None:
        super().__init__(rid, room)
        self.worker = worker
        self.page_size = page_size
        self.pages: list[int] | None = None
        self.skip_pages = 0
        self.aux_slot: int | None = None
        self.aux: AuxRow | None = None
        self.drained = False

    def init(self, dst_page_ids: Sequence[int], aux_slot: int, skip_pages: int = 0) -> None:
        assert self.pages is None, "init() twice"
        self.pages, self.aux_slot, self.skip_pages = list(dst_page_ids), aux_slot, skip_pages
        if self.state != KVPoll.Failed:
            self.state = KVPoll.Transferring

    def complete(self, prompt: list[int], first_token: int, cached_tokens: int = 0) -> None:
        """Prefill's WRITEs landed: the prompt's KV in decode's pages, the aux row, Success."""
        assert self.pages is not None and self.worker is not None
        ps = self.page_size
        for i, token in enumerate(prompt[self.skip_pages * ps :]):
            self.worker.kv[self.pages[i // ps] * ps + i % ps] = token
        self.aux = AuxRow(first_token=first_token, cached_tokens=cached_tokens, room=self.room)
        self.state = KVPoll.Success

    def aux_row(self) -> AuxRow | None:
        return self.aux

    def pages_releasable(self) -> bool:
        if self.aux_slot is None or self.state == KVPoll.Success:
            return True
        return self.state == KVPoll.Failed and self.drained


@dataclass
class FakeKVManager:
    worker: FakeModelWorker | None = None
    page_size: int = 4
    bootstrap_port: int = 8998
    senders: dict[str, FakeSender] = field(default_factory=dict)
    receivers: dict[str, FakeReceiver] = field(default_factory=dict)
    shut_down: bool = False

    def create_sender(self, rid: str, room: int) -> FakeSender:
        self.senders[rid] = FakeSender(rid, room)
        return self.senders[rid]

    def create_receiver(self, rid: str, room: int, host: str, port: int) -> FakeReceiver:
        self.receivers[rid] = FakeReceiver(rid, room, self.worker, self.page_size)
        return self.receivers[rid]

    def stats(self) -> dict[str, Any]:
        return {"transfers": len(self.senders) + len(self.receivers)}

    def health(self) -> str | None:
        return None

    def shutdown(self) -> None:
        self.shut_down = True


class FakeWorkerKVPool:
    """Decode retraction's host copy over the fake worker's KV (one "layer": the tokens)."""

    device = torch.device("cpu")

    def __init__(self, worker: FakeModelWorker) -> None:
        self.worker = worker

    def host_copy_bytes(self, num_tokens: int) -> int:
        return 2 * 8 * num_tokens

    def copy_slots_to_host(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.tensor([[self.worker.kv[int(s)] for s in slots]], dtype=torch.int64)
        return tokens, tokens.clone()

    def restore_slots_from_host(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        for slot, token in zip(slots.tolist(), k[0].tolist(), strict=True):
            self.worker.kv[slot] = token
