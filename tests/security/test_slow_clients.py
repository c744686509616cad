"""Issue 23, slow clients: sockets that never finish a request head, and stream readers that
never read, cannot starve real clients of the router or of an instance.

Both processes start with the soft open-file limit of a stock distribution (1,024; the
hard limit is the machine's), as the report's processes did. 2,000 half-sent heads must
not keep a real request from being served, and the server closes them once
--header-timeout has passed. A client that stops reading its stream is cut off (its
connection closed, no [DONE]) and its request aborted upstream.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.router.router_procs import RouterProc, StubWorker, pd_args
from tests.security.front_procs import NonReader, SlowSockets, distro_nofile_limit, metric, wait_for
from tests.server.server_procs import ServerProcess

HEADER_TIMEOUT_S = 2.0
SLOW_SOCKETS = 2000
REAL_REQUEST_BOUND_S = 5.0  # the bound for a real request while the slow sockets are open
BACKLOG = 16


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
                   "--header-timeout", str(HEADER_TIMEOUT_S), "--max-stream-backlog", str(BACKLOG))
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
                               "--max-stream-backlog", str(BACKLOG))
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
