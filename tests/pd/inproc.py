"""A prefill and a decode engine in this process, built by their real role specs, joined by
real KVManagers (NIXL over UCX, ZMQ bootstrap on 127.0.0.1), stepped by the test.

    pd = InProcessPD(tiny_llama_path, prefill_args={...}, decode_args={...})
    pd.submit("a", prompt, max_new_tokens=8)       # the same request, one room, both roles
    pd.pump()                                        # one engine-loop iteration of each role
    pd.run_until_finished(["a"]); pd.tokens("a")
    pd.close()                                       # checks both pools' integrity first

The test owns the clock: nothing steps unless it calls pump(), so a state such as "decode
admits a transfer while its overlap step is still in flight" is reached on purpose.
"""

from __future__ import annotations

import random
import time
from typing import Any

from common.engine_core import build_engine_core
from common.sampling_params import SamplingParams
from common.scheduler.messages import BootstrapInfo, TokenOut
from common.scheduler.req import Req
from common.scheduler.role import RoleSpec
from common.server.server_args import ServerArgs
from decode_server.role import decode_role
from prefill_server.role import prefill_role
from tests.server.server_procs import free_port

COMMON: dict[str, Any] = {"device": "cpu", "dtype": "float32", "page_size": 4, "max_total_tokens": 2048}


class Collector:
    def __init__(self) -> None:
        self.outputs: dict[str, list[TokenOut]] = {}

    def __call__(self, items: list[TokenOut]) -> None:
        for item in items:
            self.outputs.setdefault(item.rid, []).append(item)

    def finished(self, rid: str) -> bool:
        outs = self.outputs.get(rid)
        return bool(outs) and outs[-1].finish_reason is not None

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outputs.get(rid, []) for t in o.new_token_ids]


class InProcessPD:
    def __init__(self, model_path: str, *, prefill_args: dict[str, Any] | None = None,
                 decode_args: dict[str, Any] | None = None, decode_role_spec: RoleSpec | None = None) -> None:
        self.model_path = model_path
        p_args = ServerArgs(model_path=model_path, disaggregation_mode="prefill",
                            disaggregation_bootstrap_port=free_port(), **{**COMMON, **(prefill_args or {})})
        d_args = ServerArgs(model_path=model_path, disaggregation_mode="decode", **{**COMMON, **(decode_args or {})})
        self.prefill_out, self.decode_out = Collector(), Collector()
        self.prefill = build_engine_core(p_args, self.prefill_out, role=prefill_role(p_args))
        try:
            self.decode = build_engine_core(d_args, self.decode_out, role=decode_role_spec or decode_role(d_args))
        except BaseException:
            self.prefill.shutdown()
            raise
        assert self.prefill.transfer is not None and self.prefill.transfer.bootstrap_port is not None
        self.bootstrap_port = self.prefill.transfer.bootstrap_port
        self.eos = frozenset(self.prefill.model_config.eos_token_ids)

    def submit(self, rid: str, prompt: list[int], max_new_tokens: int, **params: Any) -> None:
        boot = BootstrapInfo("127.0.0.1", self.bootstrap_port, random.randrange(2**63))
        sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **params)
        for core in (self.prefill, self.decode):
            core.scheduler.add_request(Req(rid=rid, origin_input_ids=list(prompt), sampling_params=sp, stream=True,
                                           eos_token_ids=self.eos, bootstrap=boot))

    def submit_local(self, rid: str, prompt: list[int], max_new_tokens: int, **params: Any) -> None:
        """To decode alone, without bootstrap info: prefilled there (needs its prefix cache)."""
        sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **params)
        self.decode.scheduler.add_request(Req(rid=rid, origin_input_ids=list(prompt), sampling_params=sp,
                                              stream=True, eos_token_ids=self.eos))

    def pump(self) -> None:
        self.prefill.run_iteration()
        self.decode.run_iteration()

    def run_until_finished(self, rids: list[str], timeout_s: float = 60.0) -> None:
        """Pump until every rid finished on decode. Bounded by time, not iterations: handshakes
        and transfers complete on the KVManagers' threads, however fast the test pumps."""
        deadline = time.monotonic() + timeout_s
        while not all(self.decode_out.finished(r) for r in rids):
            if time.monotonic() > deadline:
                raise AssertionError(f"not finished within {timeout_s}s: "
                                     f"{[r for r in rids if not self.decode_out.finished(r)]}")
            self._pump_or_wait()

    def tokens(self, rid: str) -> list[int]:
        return self.decode_out.tokens(rid)

    def settle(self, timeout_s: float = 60.0) -> None:
        """Pump until both roles are idle (transfers acknowledged, deferred pages freed)."""
        deadline = time.monotonic() + timeout_s
        while self.prefill.scheduler.has_work or self.decode.scheduler.has_work:
            if time.monotonic() > deadline:
                raise AssertionError(f"PD engines did not go idle within {timeout_s}s")
            self._pump_or_wait()
        self.pump()  # the idle iteration frees deferred pages and checks the pools

    def _pump_or_wait(self) -> None:
        self.pump()
        if not (self.prefill.scheduler.has_runnable_work or self.decode.scheduler.has_runnable_work):
            time.sleep(0.001)  # only transfers in flight: let the managers' threads run

    def close(self) -> None:
        try:
            self.settle()
            self.prefill.scheduler.kv.check_integrity()
            self.decode.scheduler.kv.check_integrity()
        finally:
            self.decode.shutdown()
            self.prefill.shutdown()
