"""A deterministic stand-in engine: a real process on the real ZMQ IPC, no model.

Output rule: token i of a request is reversed(prompt_ids)[i % len(prompt)], one
token per running request every TOKEN_PERIOD_S. It honours max_new_tokens,
stop_token_ids, eos (from config.json) and ignore_eos, answers StatsReq, and
handles AbortReq (counted in its stats, plus `abort_rid_<rid>` = 1 per aborted
rid so tests can tell which request was aborted).

Rare states on demand: rid prefix "fail-" ends the request with an engine error
(500) after two tokens; --disaggregation-fault-spec crash_on_start makes the
engine die before it reports ready.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

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
from common.server.server_args import ServerArgs

TOKEN_PERIOD_S = 0.005
FAIL_PREFIX = "fail-"


def fake_output_ids(prompt_ids: list[int], n: int) -> list[int]:
    rev = prompt_ids[::-1]
    return [rev[i % len(rev)] for i in range(n)]


def fake_logprob(token_id: int) -> float:
    return -((token_id % 7) + 1) / 10


@dataclass
class _Running:
    req: GenerateReq
    produced: int = 0


class FakeEngine:
    def __init__(self, args: ServerArgs, addrs: EngineIpcAddrs) -> None:
        self.channel = EngineChannel(addrs)
        config = json.loads((Path(args.model_path or ".") / "config.json").read_text())
        self.eos_id: int = config["eos_token_id"]
        self.vocab_size: int = config["vocab_size"]
        self.running: dict[str, _Running] = {}
        self.stats: dict[str, float] = {
            "pid": float(os.getpid()),
            "requests_received": 0.0,
            "aborts_received": 0.0,
        }

    def run(self) -> None:
        self.channel.send_ready(
            {
                "pid": float(os.getpid()),
                "max_total_tokens": 4096.0,
                "num_pages": 257.0,
                "kv_pool_bytes": float(1 << 20),
            }
        )
        next_step = time.monotonic()
        while True:
            timeout = max(0.0, next_step - time.monotonic()) if self.running else 0.05
            for msg in self.channel.recv_requests(timeout_s=timeout):
                self._handle(msg)
            if self.running and time.monotonic() >= next_step:
                self._step()
                next_step = time.monotonic() + TOKEN_PERIOD_S

    def _handle(self, msg: GenerateReq | AbortReq | StatsReq) -> None:
        if isinstance(msg, StatsReq):
            stats = {**self.stats, "num_running_reqs": float(len(self.running))}
            self.channel.send(StatsResp(seq=msg.seq, stats=stats))
        elif isinstance(msg, GenerateReq):
            self.stats["requests_received"] += 1
            self.running[msg.rid] = _Running(msg)
            if msg.sampling_params.max_new_tokens == 0:
                self._reply([self._out(self.running.pop(msg.rid), [], FinishReason(type="length"))])
        else:
            self.stats["aborts_received"] += 1
            self.stats[f"abort_rid_{msg.rid}"] = 1.0
            run = self.running.pop(msg.rid, None)
            if run is not None:
                self._reply([self._out(run, [], FinishReason(type="abort", message=msg.reason))])

    def _step(self) -> None:
        outs: list[TokenOut] = []
        for rid, run in list(self.running.items()):
            req = run.req
            token = fake_output_ids(req.input_ids, run.produced + 1)[-1]
            run.produced += 1
            params = req.sampling_params
            finish: FinishReason | None = None
            if rid.startswith(FAIL_PREFIX) and run.produced > 2:
                finish = FinishReason(type="abort", message="injected engine failure", status_code=500)
            elif token in params.stop_token_ids or (token == self.eos_id and not params.ignore_eos):
                finish = FinishReason(type="stop", matched_token=token)
            elif run.produced >= params.max_new_tokens:
                finish = FinishReason(type="length")
            if finish is not None:
                del self.running[rid]
            outs.append(self._out(run, [token], finish))
        self._reply(outs)

    def _out(self, run: _Running, ids: list[int], finish: FinishReason | None) -> TokenOut:
        req = run.req
        top = None
        if req.top_logprobs_num:
            top = [
                [((t + k) % self.vocab_size, fake_logprob(t) - k) for k in range(req.top_logprobs_num)]
                for t in ids
            ]
        return TokenOut(
            rid=req.rid,
            new_token_ids=ids,
            finish_reason=finish,
            prompt_tokens=len(req.input_ids),
            completion_tokens=run.produced,
            cached_tokens=0,
            new_token_logprobs=[fake_logprob(t) for t in ids] if req.return_logprob else None,
            new_top_logprobs=top,
        )

    def _reply(self, outs: list[TokenOut]) -> None:
        if outs:
            self.channel.send(BatchTokenOut(items=outs))


def fake_engine_main(args: ServerArgs, addrs: EngineIpcAddrs) -> None:
    if args.disaggregation_fault_spec == "crash_on_start":
        raise RuntimeError("injected crash before ready")
    FakeEngine(args, addrs).run()


def serve(argv: list[str]) -> None:
    """A whole instance (real frontend) on the fake engine; used as `python -c` by the tests."""
    from common.server.launch import main

    main(argv, engine_main=fake_engine_main)
