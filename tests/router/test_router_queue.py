"""A burst waits for room, and a missing load report never reads as "no room" (issue 41, item 5).

The decode stub reports 64 KV tokens; each request reserves 3 + 4 = 7. After one good report
its /get_load fails (503, then too slow to answer): the router's prediction (report minus what
it sent since) would call the decode full after 9 requests and hold the 10th until a report
arrives, which never does. With the report marked stale, 30 requests in a row all complete.
The queue's wait is unbounded by default (--queue-timeout is opt-in).
"""

from __future__ import annotations

import httpx
import pytest

from router.config import RouterConfig
from tests.router.router_procs import Cluster
from tests.router.stub_worker import generate_ids
from tests.server.server_procs import wait_until

KV_TOKENS, REQUESTS, MAX_NEW = 64, 30, 4


def test_queue_wait_is_unbounded_by_default_and_timeout_opt_in(tiny_llama_path: str) -> None:
    base = ["--model-path", tiny_llama_path, "--decode", "http://127.0.0.1:1", "--prefill", "http://127.0.0.1:2"]
    assert RouterConfig.from_args(base).queue_timeout is None
    assert RouterConfig.from_args([*base, "--queue-timeout", "5"]).queue_timeout == 5.0
    with pytest.raises(ValueError):
        RouterConfig.from_args([*base, "--queue-timeout", "0"])


@pytest.mark.parametrize("failure", [{"load_status": 503}, {"load_delay_s": 2.0}], ids=["503", "slow"])
def test_failed_load_report_does_not_read_as_no_room(cluster: Cluster, failure: dict[str, float]) -> None:
    p, d = cluster.stubs("prefill", "decode")
    d.control(kv_total_tokens=KV_TOKENS)
    router = cluster.router([
        "--prefill", p.url, str(p.port + 1), "--decode", d.url, "--health-check-interval", "0.2",
        "--health-check-timeout", "0.5", "--load-report-interval", "0.1",
    ], wait=False)
    router.wait_up()
    router.wait_ready()
    assert wait_until(lambda: router.workers()[d.url]["load_report"] is not None, 10.0)
    d.control(**failure)
    d.reset()  # the router's readiness round trip is not one of ours
    assert wait_until(lambda: router.workers()[d.url]["load_report"]["stale"], 10.0), "the failure was not seen"

    with httpx.Client(timeout=15.0) as client:  # bounded: "no room" would hold a request until this passes
        for i in range(REQUESTS):
            prompt = [7, i + 1, 3]
            r = client.post(router.url + "/generate", json={"input_ids": prompt,
                                                            "sampling_params": {"max_new_tokens": MAX_NEW}})
            assert r.status_code == 200, (i, r.text)
            assert r.json()["output_ids"] == generate_ids(prompt, MAX_NEW)
    assert REQUESTS * (3 + MAX_NEW) > KV_TOKENS  # the stale prediction alone would have called it full
    assert d.stats()["completed"] == REQUESTS
