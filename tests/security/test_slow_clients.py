"""Issue 23, slow clients: sockets that never finish a request head, and stream readers that
never read, cannot starve real clients of the router or of an instance. Security review 2, M2:
nor can bodies that stall or trickle (a whole-request deadline and a minimum rate), nor a body
the server has already answered (415/413: the connection closes), nor many big unfinished bodies
together (a per-process budget, 503 past it).

Both processes start with the soft open-file limit of a stock distribution (1,024; the
hard limit is the machine's), as the report's processes did. 2,000 half-sent heads must
not keep a real request from being served, and the server closes them once
--header-timeout has passed. A client that stops reading its stream is cut off (its
connection closed, no [DONE]) and its request aborted upstream.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from common.server.conn_limits import RATE_WINDOW_S
from tests.router.router_procs import RouterProc, StubWorker, pd_args
from tests.security.front_procs import (
    NonReader,
    PartialBody,
    SlowSockets,
    distro_nofile_limit,
    metric,
    wait_for,
)
from tests.server.server_procs import ServerProcess

HEADER_TIMEOUT_S = 2.0
SLOW_SOCKETS = 2000
REAL_REQUEST_BOUND_S = 5.0  # the bound for a real request while the slow sockets are open
BACKLOG = 16
BODY_TIMEOUT_S = 4.0
MIN_BODY_RATE = 1024  # bytes/s, checked over conn_limits.RATE_WINDOW_S windows
BODY_BUDGET = 12 << 20
BODY_ARGS = ("--body-timeout", str(BODY_TIMEOUT_S), "--min-body-rate", str(MIN_BODY_RATE),
             "--max-body-bytes-in-flight", str(BODY_BUDGET))


@pytest.fixture(scope="module")
def stub_pd() -> Iterator[tuple[StubWorker, StubWorker]]:
    p, d = StubWorker("prefill", wait=False), StubWorker("decode", wait=False, token_delay_s=0.001)
    try:
        p.wait_up()
        d.wait_up()
        yield p, d
    finally:
        p.stop()
        d.stop()


@pytest.fixture(scope="module")
def router(long_ctx_model: Path, stub_pd: tuple[StubWorker, StubWorker]) -> Iterator[RouterProc]:
    args = pd_args([stub_pd[0]], [stub_pd[1]], "--health-check-interval", "0.2",
                   "--header-timeout", str(HEADER_TIMEOUT_S), "--max-stream-backlog", str(BACKLOG), *BODY_ARGS)
    with distro_nofile_limit():
        r = RouterProc(long_ctx_model, args, wait=False)
    try:
        r.wait_up()
        r.wait_ready()
        yield r
    finally:
        r.stop()


@pytest.fixture(scope="module")
def inst(long_ctx_model: Path) -> Iterator[ServerProcess]:
    with distro_nofile_limit():
        server = ServerProcess(long_ctx_model, "--header-timeout", str(HEADER_TIMEOUT_S),
                               "--max-stream-backlog", str(BACKLOG), *BODY_ARGS)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("which", ["router", "instance"])
def test_real_request_served_while_2000_sockets_send_partial_heads(which: str, router: RouterProc,
                                                                  inst: ServerProcess) -> None:
    url, port = (router.url, router.port) if which == "router" else (inst.url, inst.port)
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}
    slow = SlowSockets(port, SLOW_SOCKETS)
    try:
        resp = httpx.post(url + "/generate", json=body, timeout=REAL_REQUEST_BOUND_S)
        assert resp.status_code == 200, resp.text
        assert len(resp.json()["output_ids"]) == 2
        # Past the header deadline the server has let every one of them go.
        assert slow.wait_all_closed(HEADER_TIMEOUT_S + 10.0) == SLOW_SOCKETS
    finally:
        slow.close()
    assert httpx.get(url + "/health", timeout=5).status_code == 200


def test_router_cuts_off_a_stream_client_that_never_reads(router: RouterProc,
                                                          stub_pd: tuple[StubWorker, StubWorker]) -> None:
    d = stub_pd[1]
    aborted = d.stats()["aborted"]
    # Cumulative /generate events (SGLang's default) grow with every token: the socket fills fast.
    body = {"input_ids": [5, 6, 7], "stream": True, "sampling_params": {"max_new_tokens": 20000}}
    client = NonReader(router.port, "/generate", body)
    cause = {"cause": "client_too_slow"}
    wait_for(lambda: metric(router.url, "router_errors_total", cause) == 1, 60, "the router cut the stream off")
    got = client.read_to_eof(30)
    assert got.startswith(b"HTTP/1.1 200") and b"[DONE]" not in got
    wait_for(lambda: d.stats()["aborted"] == aborted + 1, 30, "decode saw its stream closed (request aborted)")
    wait_for(lambda: all(w["in_flight_requests"] == 0 for w in router.workers().values()), 10, "load released")
    ok = httpx.post(router.url + "/generate", json={**body, "stream": False, "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200


def test_instance_cuts_off_a_stream_client_that_never_reads(inst: ServerProcess) -> None:
    body = {"input_ids": [5, 6, 7], "stream": True, "incremental_stream": False, "rid": "never-reads",
            "sampling_params": {"max_new_tokens": 20000, "ignore_eos": True}}
    client = NonReader(inst.port, "/generate", body)
    wait_for(lambda: metric(inst.url, "pdserve_stream_cut_off_total") == 1, 60, "the instance cut the stream off")
    got = client.read_to_eof(30)
    assert got.startswith(b"HTTP/1.1 200") and b"[DONE]" not in got
    # The engine was told to abort it (the fake engine reports each aborted rid) and nothing is left.
    wait_for(lambda: metric(inst.url, "pdserve_abort_rid_never_reads") == 1, 10, "the engine aborted it")
    assert metric(inst.url, "pdserve_frontend_in_flight_requests") == 0


def _url_port(which: str, router: RouterProc, inst: ServerProcess) -> tuple[str, int]:
    return (router.url, router.port) if which == "router" else (inst.url, inst.port)


@pytest.mark.parametrize("which", ["router", "instance"])
def test_m2_stalled_and_trickled_bodies_are_closed(which: str, router: RouterProc, inst: ServerProcess) -> None:
    """Half a body then nothing (closed by the rate check), and a body sent fast enough for the rate
    but never finished (closed by the whole-request deadline); real requests go on meanwhile."""
    url, port = _url_port(which, router, inst)
    stalled = PartialBody(port, "/generate", 1 << 20)
    assert stalled.send(b'{"input_ids": [' + b"5, " * 1000)
    steady = PartialBody(port, "/generate", 1 << 20)
    try:
        took = steady.trickle_until_closed(b"5, " * 1500, 0.5, BODY_TIMEOUT_S + 6)  # ~9 KB/s > min rate
        assert took >= BODY_TIMEOUT_S - 0.5, took  # the rate held: the deadline closed it
        assert stalled.closed() and stalled.answer == b""
        assert time.monotonic() - stalled.started < BODY_TIMEOUT_S + 6
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}
        assert httpx.post(url + "/generate", json=body, timeout=10).status_code == 200
    finally:
        stalled.close()
        steady.close()
    assert "Traceback" not in (router.output() if which == "router" else inst.log())


@pytest.mark.parametrize("which", ["router", "instance"])
def test_m2_answered_body_closes_the_connection(which: str, router: RouterProc, inst: ServerProcess) -> None:
    """415 (not JSON) and 413 (too big) are answered before the body is read; the connection then
    closes at once instead of swallowing whatever the client goes on sending."""
    _, port = _url_port(which, router, inst)
    for declared, ctype, status in ((1 << 20, "text/plain", b"415"), (64 << 20, "application/json", b"413")):
        c = PartialBody(port, "/generate", declared, content_type=ctype)
        try:
            took = c.trickle_until_closed(b"x" * 3000, 0.2, RATE_WINDOW_S)
            assert c.answer.startswith(b"HTTP/1.1 " + status), c.answer[:200]
            assert b"connection: close" in c.answer.lower()
            assert took < RATE_WINDOW_S
        finally:
            c.close()


def test_m2_unfinished_bodies_share_one_budget(router: RouterProc) -> None:
    """Bodies being received hold at most --max-body-bytes-in-flight together: the body that would
    pass it is refused (503, best effort: the client is still sending, so its kernel may see only
    the reset) and its connection closed; the others go on (until the rate check ends them)."""
    chunk = b" " * (5 << 20)
    conns = [PartialBody(router.port, "/generate", 6 << 20) for _ in range(3)]
    try:
        for c in conns:
            c.send(chunk)
        wait_for(lambda: any(c.closed() for c in conns), RATE_WINDOW_S * 0.75, "one body refused")
        refused = [c for c in conns if c.closed()]
        assert len(refused) == 1
        assert refused[0].answer in (b"",) or refused[0].answer.startswith(b"HTTP/1.1 503"), refused[0].answer[:200]
    finally:
        for c in conns:
            c.close()
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}
    assert httpx.post(router.url + "/generate", json=body, timeout=10).status_code == 200
