"""PrefillScheduler and DecodeScheduler in-process: the fake model worker and a fake transfer
manager (tests/pd/fake_transfer.py), every queue reached on purpose. The real-process
tests (test_pd_e2e.py, tests/kv_transfer) cover the same roles over real NIXL.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from common.cache import PageAllocator, RadixCache, ReqToTokenPool
from common.sampling_params import SamplingParams
from common.scheduler.config import SchedulerConfig
from common.scheduler.executor import Executor, LaunchExecutor, SyncExecutor
from common.scheduler.fake_worker import FakeModelWorker, reference_generate
from common.scheduler.kv_manager import ReqKVManager
from common.scheduler.messages import BootstrapInfo, TokenOut
from common.scheduler.req import Req
from common.scheduler.sim_device import SimulatedDeviceWorker
from decode_server.scheduler import DecodeScheduler
from kv_transfer import AuxSlotAllocator, FailureCause, KVPoll
from prefill_server.scheduler import PrefillScheduler
from tests.pd.fake_transfer import FakeKVManager, FakeWorkerKVPool

VOCAB = 997
PS = 4


@dataclass
class Role:
    scheduler: PrefillScheduler | DecodeScheduler
    worker: FakeModelWorker
    transfer: FakeKVManager
    outputs: dict[str, list[TokenOut]] = field(default_factory=dict)

    def collect(self, items: list[TokenOut]) -> None:
        for item in items:
            self.outputs.setdefault(item.rid, []).append(item)

    def iterate(self, n: int = 1) -> None:
        """n iterations of the engine loop: poll transfers, step, flush, idle check."""
        for _ in range(n):
            self.scheduler.poll_transfers()
            if self.scheduler.has_runnable_work:
                self.scheduler.step()
            self.scheduler.flush()
            if not self.scheduler.has_work:
                self.scheduler.on_idle()

    def serve_transferred(self, rid: str, prompt: list[int], max_new_tokens: int, room: int,
                          iterations: int) -> list[int]:
        """Decode: one request whose KV arrives at once (prefill's first token), run `iterations`
        loop iterations; its tokens so far."""
        self.scheduler.add_request(request(rid, prompt, max_new_tokens, room=room))
        self.iterate()
        self.transfer.receivers[rid].complete(prompt, reference_generate(prompt, 1, VOCAB)[0])
        self.iterate(iterations)
        return self.tokens(rid)

    def final(self, rid: str) -> TokenOut:
        out = self.outputs[rid][-1]
        assert out.finish_reason is not None, f"{rid} has not finished"
        return out

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outputs.get(rid, []) for t in o.new_token_ids]

    @property
    def pages_in_use(self) -> int:
        return self.scheduler.kv.in_use_pages() + len(self.scheduler.kv.deferred_pages)


def _parts(num_pages: int, overlap: bool, decode: bool, radix: bool, **cfg: object):  # type: ignore[no-untyped-def]
    config = SchedulerConfig(page_size=PS, enable_overlap=overlap, disable_radix_cache=not radix, **cfg)  # type: ignore[arg-type]
    allocator = PageAllocator(num_pages, PS)
    kv = ReqKVManager(allocator, RadixCache(allocator, PS, disable=not radix), ReqToTokenPool(16, 512), defer_frees=decode)
    worker = FakeModelWorker(vocab_size=VOCAB, num_slots=num_pages * PS, max_reqs=16, future_capacity=128)
    return config, kv, worker


def make_prefill(num_pages: int = 128, **cfg: object) -> Role:
    config, kv, worker = _parts(num_pages, overlap=False, decode=False, radix=True, **cfg)
    role = Role(None, worker, FakeKVManager(page_size=PS))  # type: ignore[arg-type]
    role.scheduler = PrefillScheduler(config, SyncExecutor(worker), kv, future_capacity=128, output=role.collect,
                                      transfer=role.transfer)  # type: ignore[arg-type]
    return role


def make_decode(num_pages: int = 128, overlap: bool | str = True, reserved: int = 8, radix: bool = False,
                local_prefill_max_tokens: int = 64, **cfg: object) -> Role:
    config, kv, worker = _parts(num_pages, overlap=bool(overlap), decode=True, radix=radix, **cfg)
    role = Role(None, worker, FakeKVManager(worker=worker, page_size=PS))  # type: ignore[arg-type]
    # overlap="device": the one-thread overlap loop over a simulated device (steps run after launch)
    executor: Executor = SyncExecutor(worker)
    if overlap == "device":
        executor = LaunchExecutor(SimulatedDeviceWorker(worker, host_s=0.0, device_s=0.0))
    role.scheduler = DecodeScheduler(
        config, executor, kv, future_capacity=128, output=role.collect, transfer=role.transfer,  # type: ignore[arg-type]
        aux_slots=AuxSlotAllocator(32), kv_pool=FakeWorkerKVPool(worker), num_reserved_decode_tokens=reserved,  # type: ignore[arg-type]
        local_prefill_max_tokens=local_prefill_max_tokens,
    )
    return role


def request(rid: str, prompt: list[int], max_new_tokens: int, room: int = 7) -> Req:
    return Req(rid=rid, origin_input_ids=list(prompt), stream=True,
               sampling_params=SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True),
               bootstrap=BootstrapInfo("127.0.0.1", 8998, room))


def prompt_of(n: int, seed: int = 1) -> list[int]:
    return [(seed * 31 + 17 * i) % (VOCAB - 4) + 4 for i in range(n)]


def pages(n_tokens: int) -> int:
    return -(-n_tokens // PS)


# ---- prefill ------------------------------------------------------------------------------------


def test_prefill_waits_for_decode_then_sends_every_page_in_order_and_caches_them() -> None:
    p = make_prefill(chunked_prefill_size=8)
    prompt = prompt_of(30)
    p.scheduler.add_request(request("a", prompt, 8))
    sender = p.transfer.senders["a"]
    p.iterate(3)
    assert p.scheduler.bootstrap_queue and not p.scheduler.waiting and not sender.sends  # bootstrapping
    sender.ready(pages(30))
    p.iterate()
    p.iterate(10)
    req_pages = sender.pages_sent
    assert len(req_pages) == pages(30) and len(set(req_pages)) == len(req_pages)
    assert [s.is_last for s in sender.sends] == [False] * (len(sender.sends) - 1) + [True]
    assert len(sender.sends) >= 4, "chunked prefill sends after each chunk"
    last = sender.sends[-1]
    assert last.aux is not None and last.aux.first_token == reference_generate(prompt, 1, VOCAB)[0]
    assert p.scheduler.inflight and "a" not in p.outputs  # waits for decode's ack
    sender.state = KVPoll.Success
    p.iterate()
    assert p.final("a").finish_reason.type == "length" and not p.scheduler.inflight
    assert p.scheduler.kv.radix.cached_pages == 30 // PS  # whole prompt pages joined the cache
    assert p.pages_in_use == 0
    p.scheduler.kv.check_integrity()


def test_prefill_sends_radix_hits_before_computing_the_rest() -> None:
    p = make_prefill(chunked_prefill_size=8)
    shared = prompt_of(24)
    for rid, prompt in (("a", shared), ("b", shared + prompt_of(9, seed=5))):
        p.scheduler.add_request(request(rid, prompt, 4, room=hash(rid) & 0xFFFF))
        p.transfer.senders[rid].ready(pages(len(prompt)))
        p.iterate(12)
        p.transfer.senders[rid].state = KVPoll.Success
        p.iterate()
        assert p.final(rid).finish_reason.type == "length"
    first_send_b = p.transfer.senders["b"].sends[0]
    assert len(first_send_b.pages) == 24 // PS and not first_send_b.is_last  # the cached prefix, at once
    assert p.final("b").cached_tokens == 24
    p.scheduler.kv.check_integrity()


@pytest.mark.parametrize("where", ["bootstrap", "waiting", "chunked", "inflight"])
def test_prefill_failure_in_each_queue_reaches_the_client_and_frees_pages(where: str) -> None:
    p = make_prefill(num_pages=64, chunked_prefill_size=8)
    p.scheduler.add_request(request("a", prompt_of(20), 4))
    sender = p.transfer.senders["a"]
    if where != "bootstrap":
        sender.ready(pages(20))
        p.scheduler.poll_transfers()  # -> waiting
        if where == "chunked":
            p.scheduler.step()
        elif where == "inflight":
            p.iterate(4)
        state = {"waiting": p.scheduler.waiting, "chunked": p.scheduler.chunked, "inflight": p.scheduler.inflight}
        assert state[where], where
    sender.fail(FailureCause.TRANSFER_TIMEOUT, "decode went quiet")
    p.iterate(2)
    final = p.final("a").finish_reason
    assert final.type == "abort" and final.status_code == 504 and "decode went quiet" in (final.message or "")
    assert final.err_type == "transfer_timeout"
    assert p.scheduler.num_transfer_failures == 1
    assert p.pages_in_use == 0 and p.scheduler.kv.radix.cached_pages == 0  # a failed prompt is not cached
    assert not (p.scheduler.bootstrap_queue or p.scheduler.waiting or p.scheduler.inflight or p.scheduler.sends)
    p.scheduler.kv.check_integrity()


def test_prefill_refuses_a_decode_that_reserved_the_wrong_page_count() -> None:
    p = make_prefill()
    p.scheduler.add_request(request("a", prompt_of(20), 4))
    p.transfer.senders["a"].ready(pages(20) - 1)
    p.iterate()
    assert "reserved 4 pages after 0 it holds, prefill needs 5" in (p.transfer.senders["a"].aborted or "")
    assert p.final("a").finish_reason.type == "abort"
    p.scheduler.kv.check_integrity()


def test_prefill_client_abort_aborts_the_sender() -> None:
    p = make_prefill()
    p.scheduler.add_request(request("a", prompt_of(20), 4))
    p.iterate()
    assert p.scheduler.abort("a", "client left")
    assert p.transfer.senders["a"].aborted == "client left" and not p.scheduler.bootstrap_queue
    p.scheduler.kv.check_integrity()


# ---- decode -------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [True, False, "device"])
def test_decode_prebuilt_request_decodes_exactly(overlap: bool) -> None:
    d = make_decode(overlap=overlap)
    prompts = {f"r{i}": prompt_of(5 + 7 * i, seed=i) for i in range(4)}
    for rid, prompt in prompts.items():
        d.scheduler.add_request(request(rid, prompt, 12, room=int(rid[1:])))
    d.iterate()
    assert len(d.scheduler.transferring) == 4  # admitted while still bootstrapping: pages handed over
    for rid, prompt in prompts.items():
        receiver = d.transfer.receivers[rid]
        assert receiver.pages is not None and len(receiver.pages) == pages(len(prompt))
        receiver.complete(prompt, reference_generate(prompt, 1, VOCAB)[0])
    for _ in range(40):
        d.iterate()
    for rid, prompt in prompts.items():
        assert d.tokens(rid) == reference_generate(prompt, 12, VOCAB), rid
    assert d.scheduler.num_prebuilt == 4 and d.pages_in_use == 0
    d.scheduler.kv.check_integrity()
    d.scheduler.aux_slots.check_integrity()


@pytest.mark.parametrize("cause,status", [(FailureCause.TRANSFER_TIMEOUT, 504), (FailureCause.PEER_LOST, 500)])
def test_decode_failure_while_transferring_holds_pages_until_drained(cause: FailureCause, status: int) -> None:
    d = make_decode()
    d.scheduler.add_request(request("a", prompt_of(20), 8))
    d.iterate()
    receiver = d.transfer.receivers["a"]
    assert receiver.pages is not None
    receiver.fail(cause, "prefill is gone")
    d.iterate(3)
    final = d.final("a").finish_reason
    assert final.type == "abort" and final.status_code == status and final.err_type == cause.value
    assert d.scheduler.draining and d.pages_in_use == pages(20)  # late WRITEs may still land
    receiver.drained = True
    d.iterate()
    assert not d.scheduler.draining and d.pages_in_use == 0 and not d.scheduler.transfers
    d.scheduler.kv.check_integrity()
    d.scheduler.aux_slots.check_integrity()


def test_decode_failure_before_admission_allocates_nothing() -> None:
    d = make_decode(num_pages=8)  # 7 usable pages: the first request's reservation fills them
    d.scheduler.add_request(request("big", prompt_of(16), 16, room=1))
    d.scheduler.add_request(request("late", prompt_of(16, seed=2), 8, room=2))
    d.iterate()
    assert [r.rid for r in d.scheduler.prealloc] == ["late"]  # waits for memory
    d.transfer.receivers["late"].fail(FailureCause.HANDSHAKE, "prefill never answered")
    d.iterate()
    assert d.final("late").finish_reason.type == "abort" and not d.scheduler.prealloc
    assert d.transfer.receivers["late"].pages is None
    d.scheduler.abort("big")
    d.transfer.receivers["big"].drained = True
    d.iterate(2)
    assert d.pages_in_use == 0
    d.scheduler.kv.check_integrity()


def test_decode_client_abort_while_transferring_aborts_the_receiver() -> None:
    d = make_decode()
    d.scheduler.add_request(request("a", prompt_of(20), 8))
    d.iterate()
    assert d.scheduler.abort("a", "client left")
    receiver = d.transfer.receivers["a"]
    assert receiver.aborted == "client left" and d.scheduler.draining
    d.iterate()
    assert d.final("a").finish_reason.status_code == 499 and d.pages_in_use == pages(20)
    receiver.drained = True
    d.iterate()
    assert d.pages_in_use == 0
    d.scheduler.kv.check_integrity()


@pytest.mark.parametrize("overlap", [True, False, "device"])
def test_decode_retracts_to_a_host_copy_and_restores_exactly(overlap: bool) -> None:
    # 16 usable pages = 64 tokens; three requests of 12 prompt + 40 output tokens cannot all fit.
    d = make_decode(num_pages=17, overlap=overlap, reserved=1)
    prompts = {f"r{i}": prompt_of(12, seed=10 + i) for i in range(3)}
    for i, (rid, prompt) in enumerate(prompts.items()):
        d.scheduler.add_request(request(rid, prompt, 40, room=i))
    for _ in range(400):
        d.iterate()
        for rid, prompt in prompts.items():
            receiver = d.transfer.receivers[rid]
            if receiver.pages is not None and receiver.state == KVPoll.Transferring:
                receiver.complete(prompt, reference_generate(prompt, 1, VOCAB)[0])
        if all(rid in d.outputs and d.outputs[rid][-1].finish_reason for rid in prompts):
            break
    assert d.scheduler.num_retractions > 0, "the pool was meant to be too small for all three"
    for rid, prompt in prompts.items():
        assert d.tokens(rid) == reference_generate(prompt, 40, VOCAB), rid
    assert not d.scheduler.retracted and d.pages_in_use == 0 and not d.scheduler.transfers
    d.scheduler.kv.check_integrity()


# ---- decode's prefix cache (--disaggregation-decode-enable-radix-cache) ---------------------------


def test_prefill_sends_only_the_pages_decode_lacks() -> None:
    p = make_prefill(chunked_prefill_size=8)
    prompt = prompt_of(30)
    p.scheduler.add_request(request("a", prompt, 4))
    sender = p.transfer.senders["a"]
    sender.ready(pages(30) - 5, skip_pages=5)  # decode holds the first 5 pages
    p.iterate(12)
    assert len(sender.pages_sent) == pages(30) - 5 and sender.sends[-1].is_last
    kv_pages = [s // PS for s in p.scheduler.reqs["a"].kv_slots[::PS]]
    assert sender.pages_sent == kv_pages[5:]  # exactly the prompt's pages from page 5 on, in order
    sender.state = KVPoll.Success
    p.iterate()
    assert p.scheduler.stats()["kv_pages_skipped_total"] == 5.0
    p.scheduler.kv.check_integrity()


def test_prefill_refuses_a_skip_that_does_not_add_up() -> None:
    p = make_prefill()
    p.scheduler.add_request(request("a", prompt_of(20), 4))
    p.transfer.senders["a"].ready(pages(20), skip_pages=1)  # 1 + 5 pages for a 5-page prompt
    p.iterate()
    assert "after 1 it holds" in (p.transfer.senders["a"].aborted or "")
    p.scheduler.kv.check_integrity()


@pytest.mark.parametrize("overlap", [True, False, "device"])
def test_decode_prefix_cache_serves_a_second_turn_with_only_its_new_pages(overlap: bool) -> None:
    d = make_decode(overlap=overlap, radix=True)
    turn1 = prompt_of(22)
    answer = d.serve_transferred("t1", turn1, 8, room=1, iterations=20)
    assert answer == reference_generate(turn1, 8, VOCAB)
    assert d.scheduler.kv.radix.cached_pages == (22 + 8 - 1) // PS  # prompt + answer, whole pages

    turn2 = turn1 + answer + prompt_of(7, seed=3)
    d.scheduler.add_request(request("t2", turn2, 8, room=2))
    d.iterate()
    receiver = d.transfer.receivers["t2"]
    assert receiver.skip_pages == 7 and receiver.pages is not None
    assert len(receiver.pages) == pages(len(turn2)) - 7  # only the pages after the shared prefix
    receiver.complete(turn2, reference_generate(turn2, 1, VOCAB)[0])  # writes only those pages
    for _ in range(20):
        d.iterate()
    assert d.tokens("t2") == reference_generate(turn2, 8, VOCAB)  # read the cached prefix correctly
    assert d.scheduler.stats()["kv_pages_from_cache_total"] == 7.0
    assert d.pages_in_use == 0
    d.scheduler.kv.check_integrity()


@pytest.mark.parametrize("overlap", [True, False, "device"])
def test_decode_caches_a_finished_turn_before_its_last_tokens_leave(overlap: bool) -> None:
    """The client's next turn can follow the last token at once: by then the finished request's
    pages must be in the tree (and so in the KV events that go out before the tokens), even
    while the overlap loop still defers their release behind the step in flight."""
    d = make_decode(overlap=overlap, radix=True)
    prompt = prompt_of(22)
    held_at_final: list[int] = []
    collect = d.collect

    def on_output(items: list[TokenOut]) -> None:
        if any(o.rid == "t1" and o.finish_reason is not None for o in items):
            held_at_final.append(d.scheduler.kv.radix.cached_pages)
        collect(items)

    d.scheduler.output = on_output
    answer = d.serve_transferred("t1", prompt, 8, room=1, iterations=20)
    assert answer == reference_generate(prompt, 8, VOCAB)
    assert held_at_final == [(22 + 8 - 1) // PS]
    assert d.pages_in_use == 0
    d.scheduler.kv.check_integrity()


@pytest.mark.parametrize("overlap", [True, False, "device"])
def test_decode_twin_turns_finishing_together_leave_no_stale_row_writes(overlap: bool) -> None:
    """Two identical conversations finish in one step: the second one's insert finds the first's
    pages in the tree and queues a row rewrite; its row is freed before that write is applied,
    and the next request that gets the row must not inherit it."""
    d = make_decode(overlap=overlap, radix=True)
    twin = prompt_of(22)
    for rid, room in (("a", 1), ("b", 2)):
        d.scheduler.add_request(request(rid, twin, 8, room=room))
    d.iterate()
    for rid in ("a", "b"):
        d.transfer.receivers[rid].complete(twin, reference_generate(twin, 1, VOCAB)[0])
    d.iterate(20)
    assert d.tokens("a") == d.tokens("b") == reference_generate(twin, 8, VOCAB)
    live_rows = {r.req_pool_idx for r in d.scheduler.kv.live}
    assert all(w.row in live_rows for w in d.scheduler.kv.pending_writes)
    other = prompt_of(30, seed=5)
    assert d.serve_transferred("c", other, 8, room=3, iterations=20) == reference_generate(other, 8, VOCAB)
    assert d.pages_in_use == 0
    d.scheduler.kv.check_integrity()


def test_decode_prefix_cache_keeps_failed_transfers_out_of_the_tree() -> None:
    d = make_decode(radix=True)
    d.scheduler.add_request(request("a", prompt_of(20), 8))
    d.iterate()
    receiver = d.transfer.receivers["a"]
    receiver.fail(FailureCause.PEER_LOST, "prefill died mid-transfer")
    receiver.drained = True
    d.iterate(3)
    assert d.final("a").finish_reason.type == "abort"
    assert d.scheduler.kv.radix.cached_pages == 0 and d.pages_in_use == 0  # late WRITEs never cached
    d.scheduler.kv.check_integrity()


def test_decode_prefix_cache_evicts_under_pressure_and_stays_exact() -> None:
    # 12 usable pages: each finished request leaves its pages in the tree; later ones need them back.
    d = make_decode(num_pages=13, radix=True, reserved=1)
    for i in range(6):
        prompt = prompt_of(17, seed=40 + i)
        assert d.serve_transferred(f"r{i}", prompt, 12, room=i, iterations=30) == reference_generate(prompt, 12, VOCAB)
    assert d.scheduler.kv.radix.cached_pages > 0 and d.pages_in_use == 0
    assert d.scheduler.stats()["kv_pages_evicted_total"] > 0
    d.scheduler.kv.check_integrity()


# ---- local prefill on decode (a request without bootstrap info) ----------------------------------


@pytest.mark.parametrize("overlap", [True, False, "device"])
def test_decode_prefills_a_short_suffix_itself_from_its_prefix_cache(overlap: bool) -> None:
    d = make_decode(overlap=overlap, radix=True)
    turn1 = prompt_of(26)
    turn2 = turn1 + d.serve_transferred("t1", turn1, 10, room=1, iterations=25) + prompt_of(5, seed=9)
    local = request("t2", turn2, 10)
    local.bootstrap = None
    d.scheduler.add_request(local)
    for _ in range(25):
        d.iterate()
    assert "t2" not in d.transfer.receivers  # nothing was asked of a prefill
    assert d.tokens("t2") == reference_generate(turn2, 10, VOCAB)
    assert d.final("t2").cached_tokens == (26 + 10 - 1) // PS * PS
    stats = d.scheduler.stats()
    assert stats["num_local_prefill_total"] == 1 and stats["num_local_prefill_cache_miss_total"] == 0
    assert stats["local_prefill_tokens_total"] == len(turn2) - (26 + 10 - 1) // PS * PS
    assert d.pages_in_use == 0
    d.scheduler.kv.check_integrity()


def test_decode_local_prefill_of_an_evicted_prefix_is_slower_but_exact() -> None:
    d = make_decode(radix=True, local_prefill_max_tokens=8)
    prompt = prompt_of(40, seed=21)  # never seen here: the router's guess was wrong
    local = request("x", prompt, 6)
    local.bootstrap = None
    d.scheduler.add_request(local)
    for _ in range(20):
        d.iterate()
    assert d.tokens("x") == reference_generate(prompt, 6, VOCAB)
    assert d.scheduler.stats()["num_local_prefill_cache_miss_total"] == 1
    d.scheduler.kv.check_integrity()


def test_decode_local_prefills_survive_retraction() -> None:
    # a near-zero new_token_ratio admits all three; 3 x (12 + 40) tokens overflow 16 pages of 4
    d = make_decode(num_pages=17, radix=True, reserved=1, chunked_prefill_size=16, schedule_conservativeness=0.05)
    prompts = {f"l{i}": prompt_of(12, seed=60 + i) for i in range(3)}
    for rid, prompt in prompts.items():
        req = request(rid, prompt, 40)
        req.bootstrap = None
        d.scheduler.add_request(req)
    for _ in range(400):
        d.iterate()
        if all(rid in d.outputs and d.outputs[rid][-1].finish_reason for rid in prompts):
            break
    assert d.scheduler.num_retractions > 0
    for rid, prompt in prompts.items():
        assert d.tokens(rid) == reference_generate(prompt, 40, VOCAB), rid
    assert d.pages_in_use == 0
    d.scheduler.kv.check_integrity()
