"""Multi-turn chats through the router + 1 prefill + 2 decodes with decode's prefix cache, KV events,
session affinity and local prefill all on (real processes, real NIXL, tiny model, fp32):

- every turn's tokens equal transformers' on the same full prompt;
- turn 1 of a session (longer than decode's local prefill limit) goes through prefill; turns 2+ go to the decode that served turn 1
  (session affinity) and are prefilled there alone (no prefill request, no transfer), since that
  decode's KV events show all but the new suffix cached;
- a prompt continuing a session without its session id still finds that decode by its KV
  events (reason "cache"), also alone;
- every pool whole at the end.
All roles share a cluster secret, so the KV events travel over CURVE.

Before each next turn the test waits for the router's index of the serving decode to move past
the previous turn (the KV event and the client's answer travel on different sockets); the
decisions themselves are asserted exactly, from the router's counters.
"""

from __future__ import annotations

import os
import random
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from common.cluster_secret import ENV_VAR
from tests.engine.reference import hf_greedy
from tests.pd.pd_procs import RoleProcess
from tests.router.router_procs import RouterProc
from tests.server.server_procs import wait_until

VOCAB = 384
MAX_NEW = 10
COMMON = ["--dtype", "float32", "--page-size", "4"]
DECODE = [*COMMON, "--max-total-tokens", "4096", "--disaggregation-decode-enable-radix-cache",
          "--disaggregation-local-prefill-max-tokens", "64"]


@dataclass
class Cluster:
    prefill: RoleProcess
    decodes: list[RoleProcess]
    router: RouterProc

    def workers(self) -> dict[str, dict[str, Any]]:
        return self.router.workers()

    def choices(self) -> dict[tuple[str, str], float]:
        out: dict[tuple[str, str], float] = {}
        for line in httpx.get(self.router.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("router_decode_choice_total{"):
                labels = dict(kv.split("=") for kv in line[line.index("{") + 1 : line.index("}")].split(","))
                out[(labels["reason"].strip('"'), labels["prefill"].strip('"'))] = float(line.split()[-1])
        return out

    def stop(self) -> None:
        self.router.stop()
        for inst in (self.prefill, *self.decodes):
            inst.stop()


@pytest.fixture(scope="module")
def cluster(tiny_llama_path: str) -> Iterator[Cluster]:
    model = Path(tiny_llama_path)
    saved = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = secrets.token_hex(32)  # every role started below inherits it
    prefill = RoleProcess("prefill_server", model, *COMMON, "--max-total-tokens", "4096")
    decodes = [RoleProcess("decode_server", model, *DECODE) for _ in range(2)]
    router = None
    try:
        for inst in (prefill, *decodes):
            inst.wait_healthy()
        args = ["--prefill", prefill.url, str(prefill.bootstrap_port), "--decode-policy", "round_robin",
                "--health-check-interval", "0.3", "--kv-event-wait", "2"]  # generous: a loaded box
        for d in decodes:
            args += ["--decode", d.url]
        router = RouterProc(model, args)
        router.wait_ready(timeout=60)
        c = Cluster(prefill, decodes, router)
        synced = wait_until(lambda: all((c.workers()[d.url]["kv_index"] or {}).get("synced") for d in decodes), 30)
        assert synced, f"router never followed decode KV events: {c.workers()}"
        yield c
    finally:
        if saved is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = saved
        if router is not None:
            router.stop()
        for inst in (prefill, *decodes):
            inst.stop()


def _generate(c: Cluster, prompt: list[int], session: str | None, *, wait_index: bool = True) -> tuple[list[int], str]:
    """One greedy request through the router; returns its tokens and the decode that served it, once
    the router's index of that decode has taken in what the request left in its cache (with
    wait_index; else at once, as a chat client that sends its next turn the instant one ends)."""
    before = c.workers()
    headers = {"x-session-id": session} if session else {}
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}}
    r = httpx.post(c.router.url + "/generate", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    after = c.workers()
    served = [d.url for d in c.decodes if after[d.url]["total_requests"] > before[d.url]["total_requests"]]
    assert len(served) == 1, served
    url = served[0]
    seq0 = before[url]["kv_index"]["seq"]
    if not wait_index:
        return r.json()["output_ids"], url
    assert wait_until(lambda: c.workers()[url]["kv_index"]["seq"] > seq0, 10), "no KV event after the request"
    return r.json()["output_ids"], url


def test_sessions_stay_on_their_decode_and_skip_prefill(cluster: Cluster, tiny_llama_path: str) -> None:
    rng = random.Random(21)
    c = cluster
    prefill_before = c.workers()[c.prefill.url]["total_requests"]
    local_before = sum(d.stat("num_local_prefill_total") or 0 for d in c.decodes)
    choices_before = c.choices()
    # first turns longer than the local prefill limit (64): they need a prefill instance
    sessions = {f"chat-{i}": [rng.randrange(3, VOCAB) for _ in range(80)] for i in range(3)}
    home: dict[str, str] = {}
    turns = 4
    for turn in range(turns):
        for sid, prompt in sessions.items():
            out, url = _generate(c, prompt, sid)
            assert out == hf_greedy(tiny_llama_path, prompt, MAX_NEW), (sid, turn)
            assert home.setdefault(sid, url) == url, f"{sid} turn {turn} left its decode"
            sessions[sid] = prompt + out + [rng.randrange(3, VOCAB) for _ in range(6)]
    assert len(set(home.values())) == 2, "round robin spreads the first turns over both decodes"

    # the same conversation without its session id: found by decode's KV events
    prompt = sessions["chat-0"]
    out, url = _generate(c, prompt, None)
    assert out == hf_greedy(tiny_llama_path, prompt, MAX_NEW) and url == home["chat-0"]

    choices = c.choices()
    delta = {k: v - choices_before.get(k, 0.0) for k, v in choices.items()}
    assert delta.get(("session", "local")) == len(sessions) * (turns - 1), delta
    assert delta.get(("cache", "local")) == 1, delta
    assert delta.get(("policy", "prefill")) == len(sessions), delta
    assert c.workers()[c.prefill.url]["total_requests"] - prefill_before == len(sessions), "later turns skip prefill"
    assert sum(d.stat("num_local_prefill_total") or 0 for d in c.decodes) - local_before == len(sessions) * (turns - 1) + 1
    assert sum(d.stat("num_local_prefill_cache_miss_total") or 0 for d in c.decodes) == 0

    def whole() -> bool:
        return all(i.stat("kv_pages_in_use") == 0 and i.stat("num_running_reqs") == 0
                   for i in (c.prefill, *c.decodes))
    assert wait_until(whole, 20), "pools not whole"


def test_back_to_back_turns_wait_for_their_kv_event(cluster: Cluster, tiny_llama_path: str) -> None:
    """Each next turn is sent the instant the last one answered: the router waits (bounded,
    --kv-event-wait) for the last turn's KV event, so every later turn is still served by its
    decode alone (issue 41: 1 in 8 used to be prefilled again)."""
    rng = random.Random(33)
    c = cluster
    choices_before = c.choices()
    sessions = {f"fast-{i}": [rng.randrange(3, VOCAB) for _ in range(80)] for i in range(3)}
    turns = 4
    for turn in range(turns):
        for sid, prompt in sessions.items():
            out, _ = _generate(c, prompt, sid, wait_index=False)
            if turn == turns - 1:
                assert out == hf_greedy(tiny_llama_path, prompt, MAX_NEW), sid
            sessions[sid] = prompt + out + [rng.randrange(3, VOCAB) for _ in range(6)]
    delta = {k: v - choices_before.get(k, 0.0) for k, v in c.choices().items()}
    assert delta.get(("session", "local")) == len(sessions) * (turns - 1), delta
