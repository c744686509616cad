"""KVManager: one per engine. Owns the NIXL agent, the buffer registrations, the control
socket(s) and the background thread that does all socket I/O, NIXL posting and progress.

    scheduler thread                         manager thread (daemon, one per manager)
    create_sender/receiver, send, init,  -->  command queue + wake pipe
    abort (all return at once)                zmq poller (idle_poll_s / busy_poll_s timeout)
    poll() reads StateCell   <-------------   PrefillSide | DecodeSide advance the cells

Tensor parallelism (tp_size N > 1): this is rank 0's manager; its agent registers rank 0's
KV slice only. Ranks 1..N-1 each run a RankAgent (rank_agent.py) over their own slice; their
hellos (agent, slice) arrive on the RankLink (rank_link.py) before this manager is built, and
the handshake with the other instance carries every rank's agent and head range.
"""

from __future__ import annotations

import contextlib
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from common.zmq_curve import CurveSecurity
from kv_transfer.base import FailureCause, KVManagerArgs, KVTransferError, StateCell
from kv_transfer.decode_side import DecodeSide
from kv_transfer.endpoint import make_endpoint
from kv_transfer.faults import FaultInjector, FaultSpec
from kv_transfer.handles import KVReceiver, KVSender
from kv_transfer.head_slices import HeadSlice, total_heads, wire_slices
from kv_transfer.messages import PROTOCOL_VERSION, PrefillInfo, Register
from kv_transfer.metrics import TransferMetrics
from kv_transfer.prefill_side import PrefillSide
from kv_transfer.rank_link import RankLink
from kv_transfer.rank_messages import RankHello
from kv_transfer.side import Side, layout_to_wire, log
from kv_transfer.ucx_env import ucx_pinned_to


class _Create:
    def __init__(self, handle: KVSender | KVReceiver) -> None:
        self.handle = handle


class KVManager:
    def __init__(self, args: KVManagerArgs) -> None:
        layout = args.layout
        want = layout.num_pages * layout.page_bytes
        kv = [args.kv_buffer]
        if args.kv_buffer.numel() * args.kv_buffer.element_size() != want or not args.kv_buffer.is_contiguous():
            raise ValueError(f"the KV pool must be one contiguous page-major tensor of {want} bytes (layout {layout})")
        self.args = args
        self.role = args.role
        self.cfg = args.config
        self.layout = layout
        self.faults = FaultInjector(FaultSpec.parse(self.cfg.faults))
        self.metrics = TransferMetrics(args.role, args.registry)  # type: ignore[arg-type]
        make = args.endpoint_factory or (lambda *a: make_endpoint(args.backend, *a))
        with ucx_pinned_to(args.bootstrap_host):  # UCX listens on --host's interface only
            self.endpoint = make(args.role, kv, args.aux_buffer.tensor, self.faults)
        self.agent_name = self.endpoint.name
        self.registered_kv_bytes = sum(t.numel() * t.element_size() for t in kv)
        self._ctx = zmq.Context()
        self.link: RankLink | None = None
        hellos: list[RankHello] = []
        if args.tp_size > 1:
            self.link = RankLink(args.tp_link, self._ctx, self.cfg.send_hwm)
            try:
                hellos = self.link.wait_hellos(args.tp_size - 1, self.cfg.handshake_timeout_s)
                for h in hellos:
                    if len(h.bases) != 1 or h.kv_mem_type != self.endpoint.kv_mem_type:
                        raise ValueError(f"TP rank {h.rank}'s agent holds {len(h.bases)} {h.kv_mem_type} buffers, "
                                         f"rank 0's {len(kv)} {self.endpoint.kv_mem_type}")
            except Exception:
                self.link.close()
                self.endpoint.close()
                self._ctx.term()
                raise
        self.head_slices = [
            HeadSlice(args.kv_head_start, layout.num_kv_heads, args.kv_buffer.data_ptr(), self.endpoint.kv_device),
            *(HeadSlice(h.head_start, layout.num_kv_heads, h.bases[0], h.kv_device) for h in hellos),
        ]
        self.security = CurveSecurity(self._ctx, args.cluster_secret.curve() if args.cluster_secret else None,
                                     self.cfg.max_msg_bytes)
        self._poller = zmq.Poller()
        self._cmds: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller.register(self._wake_r, zmq.POLLIN)
        if self.link is not None:
            self._poller.register(self.link.sock, zmq.POLLIN)
        self._stop = threading.Event()
        self._closed = False
        self._accepting = True  # False once the thread is leaving: new handles fail at once
        self._accept_lock = threading.Lock()
        common: dict[str, Any] = dict(
            cfg=self.cfg, endpoint=self.endpoint, metrics=self.metrics, fail=self._fail, poller=self._poller, ctx=self._ctx,
            security=self.security,
        )
        self.side: Side
        if args.role == "prefill":
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.SNDHWM, self.cfg.send_hwm)
            router.setsockopt(zmq.ROUTER_HANDOVER, 1)
            self.security.serve(router)
            host = args.bootstrap_host
            if args.bootstrap_port == 0:
                self.bootstrap_port = router.bind_to_random_port(f"tcp://{host}")
            else:
                router.bind(f"tcp://{host}:{args.bootstrap_port}")
                self.bootstrap_port = args.bootstrap_port
            self._poller.register(router, zmq.POLLIN)
            info = PrefillInfo(
                PROTOCOL_VERSION, self.agent_name, host, self.bootstrap_port, layout_to_wire(layout), args.aux_buffer.row_bytes,
                args.rank, wire_slices(self.head_slices), [h.agent_name for h in hellos],
            )
            self.side = PrefillSide(
                layout=layout, slices=self.head_slices, aux=args.aux_buffer, info=info, faults=self.faults, sock=router,
                link=self.link, **common,
            )
        elif args.role == "decode":
            self.bootstrap_port = 0
            reg = Register(
                PROTOCOL_VERSION,
                self.agent_name,
                self.endpoint.metadata(),
                layout_to_wire(layout),
                [hs.base for hs in self.head_slices],
                self.endpoint.kv_mem_type,
                self.endpoint.kv_device,
                args.aux_buffer.tensor.data_ptr(),
                args.aux_buffer.row_bytes,
                args.aux_buffer.num_slots,
                secrets.token_bytes(16),
                wire_slices(self.head_slices),
                [h.agent_metadata for h in hellos],
                [hs.device for hs in self.head_slices],
            )
            self.side = DecodeSide(layout=layout, aux=args.aux_buffer, register=reg, total_heads=total_heads(self.head_slices),
                                   **common)
        else:
            raise ValueError(f"role must be 'prefill' or 'decode', got {args.role!r}")
        self._loop_at = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"kv-transfer-{args.role}", daemon=True)
        self._thread.start()
        log.info("%s KVManager %s up (bootstrap port %d, %s)", args.role, self.agent_name, self.bootstrap_port,
                 "CURVE with the cluster secret" if self.security.authenticated else "unauthenticated")

    # ---- scheduler-facing API (never blocks) ---------------------------------------------
    def create_sender(self, rid: str, room: int) -> KVSender:
        self._require("prefill")
        sender = KVSender(rid, room, self._submit, self._fail)
        self._submit(_Create(sender))
        return sender

    def create_receiver(self, rid: str, room: int, bootstrap_host: str, bootstrap_port: int) -> KVReceiver:
        self._require("decode")
        receiver = KVReceiver(
            rid, room, bootstrap_host, bootstrap_port, self.args.aux_buffer, self.layout.num_pages, self._submit, self._fail
        )
        self._submit(_Create(receiver))
        return receiver

    def stats(self) -> dict[str, Any]:
        out = self.metrics.stats()
        out["injected_faults"] = dict(self.faults.injected)
        out["rank0_registered_bytes"] = self.registered_kv_bytes  # KV only (the aux buffer aside)
        if isinstance(self.side, PrefillSide):
            out["rank0_descriptors"], out["rank0_bytes"] = self.side.own_descs, self.side.own_bytes
        if self.link is not None:
            out.update(self.link.rank_stats(moves=self.role == "prefill"))
        return out

    def health(self) -> str | None:
        """Why this manager cannot move KV now (its thread died or is stuck), or None.

        Every live handle already failed if the thread died (its exit fails them); a stuck
        thread (one iteration past stall_report_s, e.g. blocked inside NIXL) fails nothing
        by itself: the owner reports it (/health 503) and refuses new requests."""
        if self._closed:
            return "KV transfer manager is shut down"
        if not self._accepting:  # the thread's exit clears it first thing
            return "KV transfer thread is not running (see the log for its crash)"
        stalled = time.monotonic() - self._loop_at
        if stalled > self.cfg.stall_report_s:
            return f"KV transfer thread has not completed an iteration for {stalled:.1f}s"
        return None

    def set_faults(self, spec: str) -> None:
        """Replace the fault-injection spec (see kv_transfer.faults); "" turns faults off."""
        self.faults.reconfigure(FaultSpec.parse(spec))

    def check_integrity(self) -> None:
        """Manager-internal bookkeeping (prefill aux rows, decode room tables) is consistent.
        Only meaningful from the manager thread's point of view; safe to call when idle."""
        self.side.check_integrity()

    def shutdown(self) -> None:
        """Fail everything still live, stop the thread (bounded), release NIXL and sockets."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wake()
        self._thread.join(self.cfg.shutdown_timeout_s)
        if self._thread.is_alive():
            log.error("kv_transfer thread did not stop within %.1fs", self.cfg.shutdown_timeout_s)
            return
        self.endpoint.close()
        self.security.close()
        self._ctx.term()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def __enter__(self) -> KVManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- internals ----------------------------------------------------------------------
    def _require(self, role: str) -> None:
        if self.role != role:
            raise KVTransferError(f"this is a {self.role} KVManager")
        if self._closed:
            raise KVTransferError("KVManager is shut down")

    def _fail(self, cell: StateCell, cause: FailureCause, reason: str) -> bool:
        if cell.fail(cause, reason):
            self.metrics.failed(cause)
            log.info("kv transfer failed (%s): %s", cause.value, reason)
            return True
        return False

    def _submit(self, cmd: object) -> None:
        with self._accept_lock:  # against the thread's exit: a command is either drained by it or refused
            if self._accepting:
                self._cmds.put(cmd)
                self._wake()
                return
        if isinstance(cmd, _Create):
            self._fail(cmd.handle.cell, FailureCause.SHUTDOWN, "kv_transfer thread is not running")

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    def _run(self) -> None:
        busy = False
        try:
            while not self._stop.is_set():
                self._loop_at = time.monotonic()
                self.faults.in_loop()
                timeout = self.cfg.busy_poll_s if busy else self.cfg.idle_poll_s
                events = dict(self._poller.poll(max(1, int(timeout * 1000.0))))
                if self._wake_r in events:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                self._drain_commands()
                self._guarded(self.side.check_peers, time.monotonic())
                for sock in events:
                    if self.link is not None and sock is self.link.sock:
                        self._guarded(self.link.on_readable, sock)
                    elif isinstance(sock, zmq.Socket):
                        self._guarded(self.side.on_readable, sock)
                busy = bool(self._guarded(self.side.tick, time.monotonic()))
                if self.link is not None and self.role == "decode":
                    self.link.pace(busy)
        except Exception:  # the thread ends: health() reports it, the finally fails every handle
            log.exception("kv_transfer thread crashed")
        finally:
            with self._accept_lock:
                self._accepting = False
            self._drain_commands()
            self.side.shutdown()
            if self.side.sock is not None:
                self.side.sock.close(linger=0)
            if self.link is not None:
                self.link.close()

    def _guarded(self, fn: Callable[..., object], arg: object) -> object:
        """Run one unit of the thread's work; a bug in it is logged, not fatal to the thread."""
        try:
            return fn(arg)
        except Exception:
            log.exception("kv_transfer: %s raised", getattr(fn, "__name__", fn))
            return False

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            try:
                if isinstance(cmd, _Create):
                    self.side.create(cmd.handle)
                else:
                    self.side.command(cmd)
            except Exception as e:  # one bad request must not take the thread (and every room) down
                log.exception("kv_transfer: %s failed", type(cmd).__name__)
                self._fail_command(cmd, f"kv_transfer could not process {type(cmd).__name__}: {e}")

    def _fail_command(self, cmd: object, reason: str) -> None:
        handle = getattr(cmd, "handle", None) or getattr(cmd, "sender", None) or getattr(cmd, "receiver", None)
        if handle is None:
            return
        self.side.fail(handle.cell, FailureCause.BAD_REQUEST, reason)
        if isinstance(handle, KVReceiver) and not handle.request_sent:
            handle.drained = True  # prefill never heard of this room: nothing can land in its pages
