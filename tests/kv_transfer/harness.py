"""Test harness: pools with known contents, a scheduler-like Driver per role, and a
worker process (multiprocessing spawn) that runs a Driver and answers ops over a Pipe.

    test process                          worker process (spawn, killed in finally)
    Worker.call("room", ...) --Pipe-->    Driver.op_room(...)   + Driver.step() loop
               <--- reply dict ---

Pool contents: page p of buffer b holds bytes derived from (seed, b) so the test can
recompute what a prefill pool holds without sharing memory; decode pools start with a
canary pattern so stray writes show up.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from common.cache.kv_pool import KVPool
from common.cluster_secret import ClusterSecret
from common.server.heap_trim import load_malloc_trim
from kv_transfer import AuxBuffer, AuxRow, AuxSlotAllocator, KVManager, KVManagerArgs, KVPoll, TransferConfig
from tests.harness.process import wait_until

CANARY = 0x5A
FAST = dict(
    bootstrap_timeout_s=1.0,
    handshake_timeout_s=2.0,
    transfer_timeout_s=1.0,
    heartbeat_interval_s=0.2,
    heartbeat_timeout_s=1.0,
    drain_timeout_s=1.0,
    settle_timeout_s=0.5,
)
# For files that check bytes or counts, not timeouts: bounds far above a loaded box's stalls
# (FAST's 1 s heartbeat timeout fails a room when a worker process is descheduled that long),
# below those files' 20-60 s waits.
UNTIMED = dict(
    bootstrap_timeout_s=10.0,
    handshake_timeout_s=10.0,
    transfer_timeout_s=10.0,
    heartbeat_interval_s=1.0,
    heartbeat_timeout_s=10.0,
)


@dataclass(frozen=True)
class PoolSpec:
    num_pages: int = 512
    page_size: int = 4
    num_layers: int = 2
    num_kv_heads: int = 2
    head_dim: int = 8
    dtype: str = "bfloat16"
    aux_slots: int = 256


def make_pool(spec: PoolSpec, seed: int | None) -> KVPool:
    """seed None: canary-filled (decode); else deterministic random bytes (prefill)."""
    pool = KVPool(
        num_layers=spec.num_layers,
        num_pages=spec.num_pages,
        page_size=spec.page_size,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        dtype=getattr(torch, spec.dtype),
    )
    for i in range(2 * spec.num_layers):  # K of layers 0..L-1, then V
        raw = pool.kv[:, i % spec.num_layers, i // spec.num_layers].view(torch.uint8)
        if seed is None:
            raw.fill_(CANARY)
        else:
            g = torch.Generator().manual_seed(seed * 1000 + i)
            raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))
    return pool


def page_bytes(pool: KVPool, buf: int, page: int) -> torch.Tensor:
    """Bytes of page `page` of layer buffer `buf` (K of layers 0..L-1, then V), read through the
    pool's [pages, layers, K/V, page_size, heads, dim] shape."""
    return pool.kv[page, buf % pool.num_layers, buf // pool.num_layers].reshape(-1).view(torch.uint8)


def make_manager(role: str, spec: PoolSpec, seed: int | None, **cfg: Any) -> tuple[KVManager, KVPool, AuxBuffer]:
    """`cfg`: TransferConfig fields, plus `cluster_secret` (bytes): the bootstrap channel over CURVE."""
    pool = make_pool(spec, seed)
    aux = AuxBuffer(spec.aux_slots)
    secret = cfg.pop("cluster_secret", None)
    config = TransferConfig(**{**FAST, **cfg})
    args = KVManagerArgs(
        role=role,  # type: ignore[arg-type]
        layout=pool.layout,
        kv_buffer=pool.kv,
        aux_buffer=aux,
        config=config,
        cluster_secret=ClusterSecret(secret) if secret is not None else None,
    )
    return KVManager(args), pool, aux


def wait_for(pred: Callable[[], bool], timeout: float, what: str = "condition") -> None:
    if not wait_until(pred, timeout, period_s=0.005):
        raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


@dataclass
class _Plan:
    handle: Any
    chunks: list[list[int]] = field(default_factory=list)
    aux: AuxRow | None = None
    hold: bool = False  # prefill: do not send until released; decode: do not init
    dst: list[int] | None = None
    aux_slot: int = 0


class Driver:
    """A scheduler stand-in: step() is one event-loop iteration (never blocks)."""

    def __init__(self, mgr: KVManager) -> None:
        self.mgr = mgr
        self.plans: dict[int | str, _Plan] = {}

    def op_room(self, room: int, chunks: list[list[int]] | None = None, first_token: int = 0,
                hold: bool = False, host: str = "", port: int = 0, dst: list[int] | None = None,
                aux_slot: int = 0, key: str | None = None) -> dict[str, Any]:
        """Start a request; `key` (default: the room) names it in this driver."""
        if self.mgr.role == "prefill":
            handle = self.mgr.create_sender(f"rid-{room}", room)
            aux = AuxRow(first_token, cached_tokens=room % 7, logprob=-0.25)
            self.plans[key or room] = _Plan(handle, [list(c) for c in chunks or []], aux, hold)
        else:
            handle = self.mgr.create_receiver(f"rid-{room}", room, host, port)
            self.plans[key or room] = _Plan(handle, hold=hold, dst=dst, aux_slot=aux_slot)
        return {}

    def op_release(self, room: int | str) -> dict[str, Any]:
        self.plans[room].hold = False
        return {}

    def op_abort(self, room: int | str, reason: str = "test abort") -> dict[str, Any]:
        self.plans[room].handle.abort(reason)
        return {}

    def op_states(self) -> dict[str, Any]:
        out = {}
        for room, plan in self.plans.items():
            h = plan.handle
            rel = h.pages_releasable() if self.mgr.role == "decode" else True
            out[room] = (int(h.poll()), h.failure_reason, h.failure_cause and h.failure_cause.value, rel)
        return {"states": out}

    def op_stats(self) -> dict[str, Any]:
        return {"stats": self.mgr.stats()}

    def op_faults(self, spec: str) -> dict[str, Any]:
        self.mgr.set_faults(spec)
        return {}

    def op_trim_heap(self) -> dict[str, Any]:
        """glibc's malloc_trim(0): freed heap pages go back to the OS, so RSS counts what is held."""
        trim = load_malloc_trim()
        assert trim is not None, "no malloc_trim in this C library"
        trim(0)
        return {}

    def state(self, room: int | str) -> KVPoll:
        return self.plans[room].handle.poll()

    def step(self) -> None:
        for plan in self.plans.values():
            h = plan.handle
            state = h.poll()
            if plan.hold or state == KVPoll.Failed:
                continue
            if self.mgr.role == "prefill":
                if state >= KVPoll.WaitingForInput and plan.chunks:
                    chunk = plan.chunks.pop(0)
                    h.send(chunk, is_last=not plan.chunks, aux=plan.aux if not plan.chunks else None)
            elif plan.dst is not None and h.aux_slot is None:
                h.init(plan.dst, plan.aux_slot)

    def run_until(self, pred: Callable[[], bool], timeout: float, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout}s waiting for {what}: {self.op_states()}")
            self.step()
            time.sleep(0.001)

    def all_terminal(self, rooms: list[int | str] | None = None) -> bool:
        rooms = list(self.plans) if rooms is None else rooms
        return all(self.state(r) in (KVPoll.Success, KVPoll.Failed) for r in rooms)


def _worker_main(conn: Any, role: str, spec: PoolSpec, seed: int | None, cfg: dict[str, Any]) -> None:
    mgr, _, _ = make_manager(role, spec, seed, **cfg)
    driver = Driver(mgr)
    conn.send({"port": mgr.bootstrap_port, "pid": os.getpid()})
    try:
        while True:
            driver.step()
            if conn.poll(0.001):
                op, kwargs = conn.recv()
                if op == "stop":
                    break
                try:
                    conn.send(getattr(driver, f"op_{op}")(**kwargs))
                except Exception:
                    conn.send({"error": traceback.format_exc()})
    finally:
        mgr.shutdown()
        conn.send({"stopped": True})


class Worker:
    """A KVManager + Driver in a spawned process. Always stop() or kill() it (fixtures do)."""

    def __init__(self, role: str, spec: PoolSpec, seed: int | None = None, **cfg: Any) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, role, spec, seed, cfg), daemon=True)
        self.proc.start()
        if not self.conn.poll(60):
            self.kill()
            raise TimeoutError("worker did not start within 60s")
        hello = self.conn.recv()
        self.port: int = hello["port"]

    def call(self, op: str, timeout: float = 10.0, **kwargs: Any) -> dict[str, Any]:
        self.conn.send((op, kwargs))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"worker did not answer {op} within {timeout}s")
        reply = self.conn.recv()
        if "error" in reply:
            raise RuntimeError(f"worker op {op} failed:\n{reply['error']}")
        return reply

    def states(self) -> dict[int, tuple[int, str | None, str | None, bool]]:
        return self.call("states")["states"]

    def wait_states(self, pred: Callable[[dict[int, tuple]], bool], timeout: float, what: str = "states") -> dict:
        deadline = time.monotonic() + timeout
        while True:
            states = self.states()
            if pred(states):
                return states
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout}s waiting for {what}: {states}")
            time.sleep(0.01)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("stop", {}))
                self.proc.join(timeout)
            except (BrokenPipeError, OSError):
                pass
        self.kill()

    def kill(self) -> None:
        if self.proc.is_alive() and self.proc.pid is not None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.join(5)


class PageAlloc:
    """Hands out distinct decode pages (1..num_pages-1, page 0 reserved) for tests."""

    def __init__(self, num_pages: int, seed: int = 0) -> None:
        self.free = list(range(1, num_pages))
        random.Random(seed).shuffle(self.free)

    def take(self, n: int) -> list[int]:
        out, self.free = self.free[:n], self.free[n:]
        assert len(out) == n, "test pool exhausted"
        return out

    def put(self, pages: list[int]) -> None:
        self.free.extend(pages)


@dataclass
class DecodeSide:
    mgr: KVManager
    driver: Driver
    aux: AuxBuffer
    slots: AuxSlotAllocator
    pages: PageAlloc
    pool: KVPool
