"""Prompt logprobs equal transformers' log-softmax on the same checkpoint (fp32, atol 1e-4):
/v1/completions echo + logprobs (+ max_tokens 0) and /generate return_logprob + logprob_start_len,
on a colocated instance and through the router over 1P1D (where prefill computes them)."""

from __future__ import annotations

import json
from functools import cache

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.compat.cluster import Cluster

PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs back home again."
ATOL = 1e-4


@cache
def reference(model: str, prompt: str) -> tuple[list[int], list[float], list[int]]:
    """(prompt ids, logprob of token i given tokens < i for i >= 1, greedy argmax at each position)."""
    ids = AutoTokenizer.from_pretrained(model).encode(prompt)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    return ids, [logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))], logprobs.argmax(-1).tolist()


def test_echo_logprobs_match_transformers(cluster: Cluster) -> None:
    """Through the router over 1P1D: the prompt's logprobs come from the prefill instance."""
    ids, ref, greedy = reference(str(cluster.model), PROMPT)
    for max_tokens in (0, 1):
        body = {"prompt": PROMPT, "max_tokens": max_tokens, "echo": True, "logprobs": 1, "temperature": 0}
        out = httpx.post(cluster.router.url + "/v1/completions", json=body, timeout=60).json()
        choice = out["choices"][0]
        lp = choice["logprobs"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][1 : len(ids)] == pytest.approx(ref, abs=ATOL)
        assert len(lp["tokens"]) == len(ids) + max_tokens == len(lp["token_logprobs"]) == len(lp["text_offset"])
        assert out["usage"]["prompt_tokens"] == len(ids) and out["usage"]["completion_tokens"] == max_tokens
        assert choice["text"] == PROMPT if max_tokens == 0 else choice["text"].startswith(PROMPT)
        for i, top in enumerate(lp["top_logprobs"][1 : len(ids)], start=1):  # what lm-eval's is_greedy reads
            assert len(top) == 1
            best = next(iter(top.values()))  # the greedy token's logprob
            assert best >= ref[i - 1] - ATOL
            if greedy[i - 1] == ids[i]:
                assert best == pytest.approx(ref[i - 1], abs=ATOL)


@pytest.mark.parametrize("where", ["router", "colocated"])
@pytest.mark.parametrize("start", [0, 5])
def test_generate_logprob_start_len(cluster: Cluster, where: str, start: int) -> None:
    ids, ref, _ = reference(str(cluster.model), PROMPT)
    url = cluster.router.url if where == "router" else cluster.colocated.url
    for max_new in (0, 3):
        body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": start, "top_logprobs_num": 2,
                "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
        for _ in range(2):  # the second run finds the prompt in the radix cache: it must not be reused
            out = httpx.post(url + "/generate", json=body, timeout=60)
            assert out.status_code == 200, out.text
            meta = out.json()["meta_info"]
            entries = meta["input_token_logprobs"]
            assert [e[1] for e in entries] == ids[start:]
            expect = ([None] if start == 0 else []) + ref[max(start, 1) - 1 :]
            assert [e[0] for e in entries][start == 0 :] == pytest.approx(expect[start == 0 :], abs=ATOL)
            assert len(meta["input_top_logprobs"]) == len(entries)
            assert meta["completion_tokens"] == len(out.json()["output_ids"]) == max_new


@pytest.mark.parametrize("where", ["router", "colocated"])
def test_stream_sends_prompt_logprobs_once(cluster: Cluster, where: str) -> None:
    """Security review 2, M1: the cumulative /generate stream carries input_*_logprobs in its first
    event only (re-sending them in every event was O(prompt x tokens) bytes), equal to the
    non-streamed answer; output logprobs stay cumulative."""
    ids, _, _ = reference(str(cluster.model), PROMPT)
    url = cluster.router.url if where == "router" else cluster.colocated.url
    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
            "stream": True, "incremental_stream": False,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    events = []
    with httpx.stream("POST", url + "/generate", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    assert len(events) >= 2
    with_input = [i for i, ev in enumerate(events) if "input_token_logprobs" in ev["meta_info"]]
    assert with_input == [0], with_input
    full = httpx.post(url + "/generate", json={**body, "stream": False}, timeout=60).json()["meta_info"]
    first = events[0]["meta_info"]
    assert first["input_token_logprobs"] == full["input_token_logprobs"]
    assert first["input_top_logprobs"] == full["input_top_logprobs"]
    assert len(events[-1]["meta_info"]["output_token_logprobs"]) == 6
