"""KV page transfer between a prefill and a decode instance (NIXL WRITE over UCX).

Every call a scheduler makes returns at once; one background thread per KVManager does
the socket I/O, posts NIXL transfers and drives their progress (the NIXL agent runs
with its progress thread OFF; an idle manager sleeps in a 50 ms ZMQ poll).

Prefill engine
--------------
    aux = AuxBuffer(num_slots)                      # source rows; the manager allocates them
    mgr = KVManager(KVManagerArgs(role="prefill", layout=pool.layout,
                                  kv_buffer=pool.kv,
                                  aux_buffer=aux, bootstrap_host=host, bootstrap_port=0,
                                  config=TransferConfig(...)))
    mgr.bootstrap_port                              # the port actually bound (0 = pick one)
    sender = mgr.create_sender(rid, room)           # Bootstrapping
    # bootstrap queue: wait for sender.poll() == KVPoll.WaitingForInput;
    # sender.num_dst_pages is then the number of pages decode reserved
    sender.send(src_page_ids, is_last=False)        # after each chunk: whole pages only
    sender.send(last_pages, is_last=True, aux=AuxRow(first_token, cached_tokens, logprob))
    # the i-th page ever sent lands in decode's i-th page; the last send may end with a
    # partial page (written whole) and must bring the total to num_dst_pages
    # inflight queue: poll() -> Transferring -> Success | Failed (sender.failure_reason)
    sender.abort(reason)

Decode engine
-------------
    aux = AuxBuffer(num_slots); slots = AuxSlotAllocator(num_slots)   # the scheduler owns slots
    mgr = KVManager(KVManagerArgs(role="decode", layout=..., kv_buffer=...,
                                  aux_buffer=aux, config=TransferConfig(...)))
    receiver = mgr.create_receiver(rid, room, bootstrap_host, bootstrap_port)
    # Bootstrapping until the prefill peer is registered (one handshake per peer), then
    # WaitingForInput; init() may be called in either state:
    receiver.init(dst_page_ids, aux_slot)           # -> Transferring
    # poll() -> Success (prefill's status message arrived AND the aux row has our room)
    #        -> Failed (receiver.failure_reason / failure_cause)
    receiver.aux_row()                              # AuxRow(first_token, cached_tokens, logprob, room, top_logprobs)
    receiver.abort(reason)
    receiver.pages_releasable()                     # free the pages only when True (after a
                                                    # failure: prefill's drain ack or drain timeout)

Both: mgr.stats() (bytes, descriptors, transfers, failures by cause, gbps = KV bytes / post -> done
seconds of the WRITE handles, latency_gbps, post_seconds, wire_seconds, injected faults),
mgr.metrics.registry (prometheus; pass KVManagerArgs.registry to share the engine's),
mgr.check_integrity(), mgr.set_faults("fail_post=0.1,...") (tests / reliability suite),
mgr.shutdown() (bounded; fails whatever is still live with cause "shutdown").
KV buffers may live on CUDA (registered as VRAM); the aux buffer is always CPU DRAM.
Rooms are 63-bit non-negative ints; a second live sender (or receiver, per prefill)
with the same room fails at once with cause "duplicate_room".
Poll states reduce across ranks with min_poll(). query_bootstrap(host, port) asks a
prefill what it publishes (PrefillInfo). Timeouts and fault injection: TransferConfig.

Tensor parallelism (KVManagerArgs.tp_size N > 1): the manager is rank 0's and its agent holds
rank 0's KV slice only; ranks 1..N-1 each start a RankAgent (rank_agent.py) over their own
slice before the ranks' start barrier, and the manager collects them (rank_link.py). The
handshake carries every rank's agent and [first KV head, heads]; prefill rank r writes the
heads it holds to the decode ranks that own them (head_slices.py), rank 0 decides what and
when, and reports a room to decode only once every rank's writes settled.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kv_transfer.aux_buffer import AuxBuffer, AuxRow, AuxSlotAllocator
    from kv_transfer.base import (
        FailureCause,
        KVManagerArgs,
        KVPoll,
        KVTransferError,
        TransferConfig,
        min_poll,
    )
    from kv_transfer.bootstrap import query_bootstrap
    from kv_transfer.faults import FaultSpec
    from kv_transfer.handles import KVReceiver, KVSender
    from kv_transfer.manager import KVManager
    from kv_transfer.messages import PrefillInfo

# Names load on first use: `import kv_transfer.aux_format` (the router, the HTTP layer) must not
# pull in torch and NIXL.
_HOME = {
    "AuxBuffer": "aux_buffer",
    "AuxRow": "aux_buffer",
    "AuxSlotAllocator": "aux_buffer",
    "FailureCause": "base",
    "KVManagerArgs": "base",
    "KVPoll": "base",
    "KVTransferError": "base",
    "TransferConfig": "base",
    "min_poll": "base",
    "query_bootstrap": "bootstrap",
    "FaultSpec": "faults",
    "KVReceiver": "handles",
    "KVSender": "handles",
    "KVManager": "manager",
    "PrefillInfo": "messages",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'kv_transfer' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kv_transfer.{home}"), name)

__all__ = [
    "AuxBuffer",
    "AuxRow",
    "AuxSlotAllocator",
    "FailureCause",
    "FaultSpec",
    "KVManager",
    "KVManagerArgs",
    "KVPoll",
    "KVReceiver",
    "KVSender",
    "KVTransferError",
    "PrefillInfo",
    "TransferConfig",
    "min_poll",
    "query_bootstrap",
]
