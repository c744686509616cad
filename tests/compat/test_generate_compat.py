"""Native /generate as SGLang's clients use it: GenerateReqInput fields at their defaults,
cumulative streams by default, deltas on request, 400 naming an unsupported field."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from common.server.server_args import ServerArgs
from router.config import RouterConfig
from tests.compat.cluster import Cluster

# What sglang.bench_serving --backend sglang sends (its defaults), plus other documented fields.
SGLANG_DEFAULTS = {
    "lora_path": None, "return_logprob": False, "return_routed_experts": False, "logprob_start_len": -1,
    "image_data": None, "return_hidden_states": False, "custom_logit_processor": None, "session_params": None,
    "log_metrics": True, "routing_key": "user-7", "return_text_in_logprobs": False, "modalities": [],
}


def _stream(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    events = []
    with httpx.stream("POST", url + "/generate", json={**body, "stream": True}, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def test_defaults_are_sglangs() -> None:
    assert ServerArgs().incremental_streaming_output is False
    assert RouterConfig(model_path="m").incremental_streaming_output is False


@pytest.mark.parametrize("where", ["router", "colocated"])
def test_cumulative_stream_ends_with_the_full_answer(cluster: Cluster, where: str) -> None:
    url = cluster.router.url if where == "router" else cluster.colocated.url
    body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                                                            "ignore_eos": True}, **SGLANG_DEFAULTS}
    full = httpx.post(url + "/generate", json=body, timeout=60).json()
    assert len(full["output_ids"]) == full["meta_info"]["completion_tokens"] == 12
    # the router's default is cumulative; the test instances run --incremental-streaming-output,
    # so the colocated one is asked for SGLang's cumulative stream per request
    events = _stream(url, body if where == "router" else {**body, "incremental_stream": False})
    last = events[-1]
    assert last["text"] == full["text"] and last["output_ids"] == full["output_ids"]
    assert last["meta_info"]["completion_tokens"] == 12 and last["meta_info"]["finish_reason"]["type"] == "length"
    for a, b in zip(events, events[1:], strict=False):
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"] and b["text"].startswith(a["text"])
    deltas = _stream(url, {**body, "incremental_stream": True})
    assert [t for ev in deltas for t in ev["output_ids"]] == full["output_ids"]
    assert "".join(ev["text"] for ev in deltas) == full["text"]


@pytest.mark.parametrize("where", ["router", "colocated"])
@pytest.mark.parametrize(("field", "value"), [
    ("lora_path", "my-adapter"), ("image_data", "http://x/cat.png"), ("return_hidden_states", True),
    ("custom_logit_processor", "x"), ("session_params", {"id": "s"}), ("sampling_params.stop_regex", "a+"),
    ("sampling_params.n", 2), ("sampling_params.min_new_tokens", 3), ("bogus_field", 1),
])
def test_unsupported_values_are_refused_by_name(cluster: Cluster, where: str, field: str, value: Any) -> None:
    url = cluster.router.url if where == "router" else cluster.colocated.url
    body: dict[str, Any] = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    if field.startswith("sampling_params."):
        body["sampling_params"][field.split(".", 1)[1]] = value
    else:
        body[field] = value
    resp = httpx.post(url + "/generate", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    assert field.split(".")[-1] in resp.json()["error"]["message"]


def test_honoured_fields(cluster: Cluster) -> None:
    url = cluster.router.url
    base = {"text": "The cat", "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    plain = httpx.post(url + "/generate", json=base, timeout=60).json()
    out = httpx.post(url + "/generate", json={**base, "rid": "compat-1", "return_logprob": True,
                                               "top_logprobs_num": 2, "return_text_in_logprobs": True}).json()
    assert out["meta_info"]["id"] == "compat-1" and out["output_ids"] == plain["output_ids"]
    lps = out["meta_info"]["output_token_logprobs"]
    assert [e[1] for e in lps] == out["output_ids"] and all(isinstance(e[2], str) for e in lps)
    assert all(len(top) == 2 for top in out["meta_info"]["output_top_logprobs"])
    seeded = {**base, "sampling_params": {**base["sampling_params"], "temperature": 1.0, "sampling_seed": 7}}
    a = httpx.post(url + "/generate", json=seeded, timeout=60).json()
    b = httpx.post(url + "/generate", json=seeded, timeout=60).json()
    assert a["output_ids"] == b["output_ids"]
    stop = plain["text"][2:4]
    if stop.strip():
        kept = httpx.post(url + "/generate", json={**base, "sampling_params": {
            **base["sampling_params"], "stop": stop, "no_stop_trim": True}}, timeout=60).json()
        assert kept["text"].endswith(stop)
