"""Tensor parallelism at the scheduler/worker seam: rank 0's scheduler drives every rank.

    rank 0   scheduler -> TPLeaderWorker.run(batch) -> StepFanout: TPStep to ranks 1..N-1 (ZMQ PUSH)
                                                    -> its own TorchModelWorker.run(batch)
    rank r   TPFollower.serve(): TPStep -> TorchModelWorker.run(batch)

Every rank runs the same WorkerBatch in the same order, so their collectives (tensor_parallel.py)
pair up; the sampled tokens are rank 0's (broadcast inside the worker). The batch goes over ZMQ
as one typed msgspec message, sent once per step; torch.distributed carries only tensors.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import msgspec
import zmq

from common.scheduler.executor import LaunchedStep, StepResult, WorkerBatch
from common.scheduler.model_worker import TorchModelWorker

logger = logging.getLogger(__name__)

SEND_TIMEOUT_S = 5.0
_SEND_RETRY_S = 0.002


class TPStep(msgspec.Struct, tag=True, frozen=True):
    batch: WorkerBatch


class TPStop(msgspec.Struct, tag=True, frozen=True):
    pass


TPMsg = TPStep | TPStop
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(TPMsg)


class RankGone(RuntimeError):
    """Another TP rank did not take its step (it died or hangs); the instance cannot go on."""


class StepFanout:
    """Rank 0's side: one PUSH socket per other rank, bound at `addrs` (ipc://). `dead_reason`
    (None while every rank runs) ends a send at once when a rank died: a dead rank's socket
    never takes the message, and the overlap loop's next step must not wait out the timeout."""

    def __init__(self, addrs: list[str], dead_reason: Callable[[], str | None] = lambda: None) -> None:
        self._dead_reason = dead_reason
        self._ctx = zmq.Context()
        self._socks: list[zmq.Socket] = []
        for addr in addrs:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(addr)
            self._socks.append(sock)

    def send(self, msg: TPMsg, timeout_s: float = SEND_TIMEOUT_S) -> None:
        frame = _ENCODER.encode(msg)
        for rank, sock in enumerate(self._socks, start=1):
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    sock.send(frame, zmq.NOBLOCK)
                    break
                except zmq.Again:
                    dead = self._dead_reason()
                    if dead is not None:
                        raise RankGone(dead) from None
                    if time.monotonic() > deadline:
                        raise RankGone(f"TP rank {rank} took no step within {timeout_s}s") from None
                    time.sleep(_SEND_RETRY_S)

    def close(self) -> None:
        for sock in self._socks:
            sock.close(0)
        self._ctx.term()


class TPLeaderWorker:
    """Rank 0's ModelWorker: every step goes to the other ranks first, then runs here."""

    def __init__(self, worker: TorchModelWorker, fanout: StepFanout) -> None:
        self.worker = worker
        self.fanout = fanout

    @property
    def future_capacity(self) -> int:
        return self.worker.future_capacity

    def on_thread_start(self) -> None:
        self.worker.on_thread_start()

    def run(self, batch: WorkerBatch) -> StepResult:
        return self.collect(self.launch(batch))

    def launch(self, batch: WorkerBatch) -> LaunchedStep:
        self.fanout.send(TPStep(dataclasses.replace(batch, grammar_mask=None) if batch.grammar_mask else batch))
        return self.worker.launch(batch)

    def collect(self, launched: LaunchedStep) -> StepResult:
        return self.worker.collect(launched)


class TPFollower:
    """Rank r > 0: runs rank 0's steps until TPStop, or until `leader_alive()` turns False."""

    def __init__(self, worker: TorchModelWorker, addr: str) -> None:
        self.worker = worker
        self._ctx = zmq.Context()
        self._inbox = self._ctx.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.LINGER, 0)
        self._inbox.connect(addr)

    def serve(self, leader_alive: Callable[[], bool], poll_s: float = 0.5) -> None:
        self.worker.on_thread_start()
        try:
            while True:
                if not self._inbox.poll(int(poll_s * 1000)):
                    if not leader_alive():
                        logger.error("TP rank 0 is gone; this rank exits")
                        return
                    continue
                msg = _DECODER.decode(self._inbox.recv())
                if isinstance(msg, TPStop):
                    return
                self.worker.run(msg.batch)
        finally:
            self._inbox.close(0)
            self._ctx.term()
