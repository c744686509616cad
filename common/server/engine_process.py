"""The engine process of an instance: receive requests over ZMQ, step the scheduler, send tokens.

    loop:  recv (non-blocking when busy, short wait when idle) -> handle messages
           -> PD roles: poll the KV transfers -> scheduler.step()
           -> token outputs go to the frontend as BatchTokenOut

One EngineLoop for every role: what differs (scheduler, transfer manager, radix cache,
deferred frees, bootstrap requirement) is the RoleSpec the role's engine main hands in
(common/scheduler/role.py), consumed whole by build_engine_core. The loop exits when the
frontend (parent) dies.
"""

from __future__ import annotations

import logging
import os
import signal
import time

from common.engine_core import EngineCore, build_engine_core
from common.scheduler import step_fault
from common.scheduler.req import Req
from common.scheduler.role import COLOCATED, RoleSpec
from common.scheduler.scheduler import RequestRejected
from common.scheduler.tp_worker import RankGone
from common.server.io_struct import (
    AbortReq,
    BatchTokenOut,
    FinishReason,
    GenerateReq,
    StatsReq,
    StatsResp,
    TokenOut,
)
from common.server.ipc import EngineChannel, EngineIpcAddrs
from common.server.liveness import StepClock, busy, step_clock_path
from common.server.server_args import ServerArgs

logger = logging.getLogger(__name__)

# Nothing in flight: block on the request socket this long between the idle checks (a request
# wakes the loop at once). 20 ms cost an idle engine ~2% of a core in wake-ups.
IDLE_WAIT_S = 0.25
WAITING_ON_PEERS_S = 0.001
PARENT_CHECK_S = 1.0


class EngineLoop:
    def __init__(self, args: ServerArgs, channel: EngineChannel, role: RoleSpec = COLOCATED,
                 run_dir: str | None = None) -> None:
        """run_dir: the instance's private directory (EngineIpcAddrs.dir), where TP ranks meet."""
        self.args = args
        self.channel = channel
        self.role = role
        self.core: EngineCore = build_engine_core(args, self._send_tokens, role=role, publish_kv_events=True,
                                                  run_dir=run_dir)
        self.scheduler = self.core.scheduler
        self.eos_token_ids = frozenset(self.core.model_config.eos_token_ids)
        self._parent = os.getppid()
        self._last_parent_check = time.monotonic()
        self.running = True

    def shutdown(self) -> None:
        self.core.shutdown()

    def make_req(self, msg: GenerateReq) -> Req:
        if self.role.needs_bootstrap and not (msg.bootstrap is None and self.role.local_prefill):
            if msg.bootstrap is None:
                raise RequestRejected(f"a {self.role.name} instance needs bootstrap_host, bootstrap_port and bootstrap_room")
            problem = self.health_problem()
            if problem is not None:
                raise RequestRejected(f"{self.role.name} instance cannot transfer KV: {problem}", status_code=503)
        return Req(
            rid=msg.rid,
            origin_input_ids=list(msg.input_ids),
            sampling_params=msg.sampling_params,
            stream=msg.stream,
            return_logprob=msg.return_logprob,
            top_logprobs_num=msg.top_logprobs_num,
            priority=msg.priority,
            eos_token_ids=self.eos_token_ids,
            bootstrap=msg.bootstrap if self.role.needs_bootstrap else None,
            # decode never runs the prompt: prompt logprobs come from the prefill instance
            logprob_start_len=msg.logprob_start_len if self.role.name != "decode" or msg.bootstrap is None else -1,
        )

    def stats(self) -> dict[str, float]:
        return self.core.ready_stats()

    def health_problem(self) -> str | None:
        """Why this engine cannot serve though its loop runs (/health turns 503); None when fine."""
        transfer = self.core.transfer
        return transfer.service.health() if transfer is not None else None

    # ---- loop -------------------------------------------------------------------------------
    def _send_tokens(self, items: list[TokenOut]) -> None:
        if self.core.kv_events is not None:
            self.core.kv_events.flush()  # cache changes go out before the tokens that let a client send its next turn
        self.channel.send(BatchTokenOut(items=items))

    def reject(self, rid: str, message: str, status_code: int = 400) -> None:
        reason = FinishReason("abort", message=message, status_code=status_code)
        self._send_tokens([TokenOut(rid, [], reason, 0, 0, 0)])

    def handle(self, msg: object) -> None:
        if isinstance(msg, GenerateReq):
            if msg.bootstrap is not None:
                step_fault.at_point("bootstrap")
            try:
                self.scheduler.add_request(self.make_req(msg))
            except RequestRejected as e:
                self.reject(msg.rid, str(e), e.status_code)
        elif isinstance(msg, AbortReq):
            self.scheduler.abort(msg.rid, msg.reason)
        elif isinstance(msg, StatsReq):
            self.channel.send(StatsResp(seq=msg.seq, stats=self.stats(), unhealthy=self.health_problem()))

    def _peers_alive(self) -> bool:
        """The frontend (parent) and, under TP, every other rank; checked once per PARENT_CHECK_S."""
        now = time.monotonic()
        if now - self._last_parent_check < PARENT_CHECK_S:
            return True
        self._last_parent_check = now
        if os.getppid() != self._parent:
            logger.warning("frontend process is gone; engine exits")
            return False
        ranks = self.core.tp_ranks
        dead = ranks.dead_reason() if ranks is not None else None
        if dead is not None:
            raise RankGone(f"{dead}; the instance cannot serve without it")
        return True

    def run(self, step_clock: StepClock | None = None) -> None:
        """step_clock: where each step's start and end go (the frontend's /health reads it)."""
        try:
            while self.running:
                if self.scheduler.has_runnable_work:
                    wait = 0.0
                elif self.scheduler.has_work:
                    wait = WAITING_ON_PEERS_S  # only transfers in progress: poll them, don't spin
                else:
                    wait = IDLE_WAIT_S
                for msg in self.channel.recv_requests(wait):
                    with busy(step_clock, _intake_phase(msg)):
                        self.handle(msg)
                self.core.run_iteration(lambda name: busy(step_clock, name))
                if not self._peers_alive():
                    break
        finally:
            self.shutdown()


def _intake_phase(msg: object) -> str:
    return "bootstrap handling" if isinstance(msg, GenerateReq) and msg.bootstrap is not None else "request intake"


def engine_main(args: ServerArgs, addrs: EngineIpcAddrs, role: RoleSpec = COLOCATED) -> None:
    """The engine process's body (logging already set up by engine_handle._engine_entry). A role's
    engine main builds its RoleSpec here, in the child."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the frontend owns Ctrl-C and stops us
    channel = EngineChannel(addrs)
    step_clock = StepClock.attach(step_clock_path(addrs))
    try:
        loop = EngineLoop(args, channel, role, run_dir=addrs.dir)
        stats = loop.core.ready_stats()
        logger.info(
            "engine ready: model %s, KV pool %d tokens (%.1f MiB)",
            loop.core.model_path,
            int(stats["max_total_tokens"]),
            stats["kv_pool_bytes"] / 2**20,
        )
        channel.send_ready(stats)
        loop.run(step_clock)
    finally:
        channel.close()
        step_clock.close()
