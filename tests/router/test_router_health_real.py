"""A busy instance is not a dead one; a hung one is (real processes, tiny model, fp32).

Busy: the prefill's forward step is forced to take SLOW_STEP_S by the engine fault hook
(--engine-fault-spec); /health answers from the step clock within 0.2 s throughout, the
router (probing every 0.2 s with a 0.5 s timeout) never marks it down, and the request
completes. Hung: a colocated worker's first forward never ends; /health turns 503 once
the step is older than --watchdog-timeout, the instance exits with a clear log, the router
marks it down and the second worker takes the traffic.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tests.pd.pd_procs import RoleProcess, start_pair
from tests.router.router_procs import RouterProc
from tests.server.server_procs import pid_alive, wait_until

FLAGS = ["--page-size", "16", "--max-total-tokens", "4096"]
PROBES = ["--health-check-interval", "0.2", "--health-check-timeout", "0.5"]
# Eight times the router's probe timeout: a /health that waited for the engine would time out
# many probes in a row.
SLOW_STEP_S = 4.0
# A /health that waited for the engine would take up to the whole step; one answered from the
# step clock takes milliseconds (0.29 s seen at load average 6). The bound tells the two apart.
HEALTH_BOUND_S = SLOW_STEP_S / 4
WATCHDOG_S = 2.0
BODY = {"input_ids": [5, 6, 7, 8, 9, 10], "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                              "ignore_eos": True}}


class InBackground:
    """One blocking HTTP call in a thread (joined with a bound)."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        self.response: httpx.Response | None = None
        self.elapsed = 0.0
        self._thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self._thread.start()

    def _run(self, url: str, body: dict[str, Any]) -> None:
        t0 = time.monotonic()
        self.response = httpx.post(url, json=body, timeout=120.0)
        self.elapsed = time.monotonic() - t0

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self, timeout_s: float) -> httpx.Response:
        self._thread.join(timeout_s)
        assert self.response is not None, f"no answer within {timeout_s}s"
        return self.response


def timed_health(url: str) -> tuple[float, int, dict[str, Any]]:
    t0 = time.monotonic()
    try:
        r = httpx.get(url + "/health", timeout=2.0)
    except httpx.HTTPError:
        return time.monotonic() - t0, 0, {}
    return time.monotonic() - t0, r.status_code, r.json()


def down_transitions(router: RouterProc) -> float:
    text = httpx.get(router.url + "/metrics", timeout=5.0).text
    return sum(float(v) for v in re.findall(r'^router_worker_health_transitions_total\{[^}]*to="down"[^}]*\} (\S+)$',
                                            text, re.M))


def test_a_long_step_is_busy_not_dead(tiny_llama_path: str) -> None:
    model = Path(tiny_llama_path)
    # Forward 1 is the router's readiness round trip; forward 2 (the test's request) takes SLOW_STEP_S.
    slow = ["--engine-fault-spec", f"slow_step_s={SLOW_STEP_S:g},after_steps=1,steps=1"]
    pair = start_pair(model, [*FLAGS, *slow], FLAGS)
    router = None
    try:
        router = RouterProc(model, ["--prefill", pair.prefill.url, str(pair.prefill.bootstrap_port),
                                    "--decode", pair.decode.url, "--max-retries", "0", *PROBES])
        router.wait_ready(timeout=60)
        # the readiness round trip ran (steps counts loop iterations: the overlap loop resolves a
        # forward one iteration later, so one forward reads 1 or 2); elapsed >= SLOW_STEP_S below
        # shows the slow forward was the test's request
        assert timed_health(pair.prefill.url)[2]["engine"]["steps"] >= 1
        request = InBackground(router.url + "/generate", BODY)
        seen: list[tuple[str, float, int, dict[str, Any]]] = []
        router_views: list[bool] = []
        deadline = time.monotonic() + SLOW_STEP_S + 60.0
        while not request.done and time.monotonic() < deadline:
            for name, inst in (("prefill", pair.prefill), ("decode", pair.decode)):
                seen.append((name, *timed_health(inst.url)))
            router_views.append(router.workers()[pair.prefill.url]["healthy"])
            time.sleep(0.1)
        response = request.result(timeout_s=5.0)
        assert response.status_code == 200, response.text
        assert len(response.json()["output_ids"]) == 4
        assert request.elapsed >= SLOW_STEP_S  # the step really took that long
        slow_answers = [s for s in seen if s[2] != 200 or s[1] >= HEALTH_BOUND_S]
        assert not slow_answers, slow_answers
        ages = [body["engine"]["step_age_s"] for name, _, _, body in seen if name == "prefill"]
        assert max(ages) >= SLOW_STEP_S - 1.0, ages  # /health was read deep inside the long step
        assert all(router_views) and down_transitions(router) == 0
    finally:
        if router is not None:
            router.stop()
        pair.stop()


def test_a_hung_step_ends_the_instance_and_the_other_worker_takes_over(tiny_llama_path: str) -> None:
    model = Path(tiny_llama_path)
    base = ["--dtype", "float32", *FLAGS]
    hung = RoleProcess("common.server", model, *base, "--engine-fault-spec", "hang",
                       "--watchdog-timeout", str(WATCHDOG_S))
    ok = RoleProcess("common.server", model, *base)
    router = None
    try:
        hung.wait_healthy()
        ok.wait_healthy()
        engine_pid = httpx.get(hung.url + "/server_info", timeout=5.0).json()["engine_pid"]
        router = RouterProc(model, ["--worker", hung.url, "--worker", ok.url, *PROBES])
        router.wait_ready(timeout=30)
        direct = InBackground(hung.url + "/generate", BODY)  # its first forward never returns
        answers: list[tuple[int, dict[str, Any]]] = []
        deadline = time.monotonic() + WATCHDOG_S + 30.0
        while time.monotonic() < deadline:
            _, status, body = timed_health(hung.url)
            answers.append((status, body))
            if status != 200:
                break
            time.sleep(0.05)
        status, body = answers[-1]
        assert status == 503, answers[-3:]
        message = body["error"]["message"]
        running_for = float(re.search(r"running for ([\d.]+)s", message).group(1))  # type: ignore[union-attr]
        assert running_for >= WATCHDOG_S and f"--watchdog-timeout {WATCHDOG_S:g}s" in message
        assert all(b["engine"]["step_age_s"] <= WATCHDOG_S for s, b in answers[:-1])
        failed = direct.result(timeout_s=30.0)
        assert failed.status_code == 503 and failed.json()["error"]["type"] == "engine_hung"

        assert hung.proc.wait(30) == 1  # the instance ended itself
        log = hung.log()
        # step 1 on the normal loop, step 2 on the overlap loop (it waits for forward 1 one iteration later)
        assert re.search(r"watchdog: the engine is hung: step [12] has been running for", log), log[-2000:]
        assert "instance exits:" in log
        assert wait_until(lambda: not pid_alive(engine_pid), 10.0)
        assert wait_until(lambda: not router.workers()[hung.url]["healthy"], 10.0)
        for _ in range(4):
            r = httpx.post(router.url + "/generate", json=BODY, timeout=60.0)
            assert r.status_code == 200, r.text
        assert router.workers()[ok.url]["healthy"] and down_transitions(router) >= 1
    finally:
        if router is not None:
            router.stop()
        hung.stop()
        ok.stop()
