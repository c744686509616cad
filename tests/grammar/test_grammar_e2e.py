"""Structured output through the router and a real 1P1D pair (tiny model, the shared
`tiny_cluster`): the openai client's response_format, /generate's regex / ebnf / json_schema, PD
tokens == the colocated instance's, bad specs refused by the router before any worker sees them."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.compat.cluster import Cluster
from tests.grammar.reference import CONSTRAINTS, SCHEMA

pytestmark = pytest.mark.usefixtures("_whole_after")


@pytest.fixture(scope="module")
def cluster(tiny_cluster: Cluster) -> Cluster:
    return tiny_cluster


@pytest.fixture(scope="module")
def _whole_after(cluster: Cluster):
    yield
    cluster.wait_whole()


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.router.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_openai_json_schema_validates(cluster: Cluster, client: openai.OpenAI) -> None:
    schema = json.loads(SCHEMA)
    for text in ("Describe a box.", "Give me a red thing"):
        out = client.chat.completions.create(
            model=client.models.list().data[0].id, messages=[{"role": "user", "content": text}], max_tokens=160,
            temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "box", "schema": schema}})
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content or ""), schema)
    out = client.completions.create(model=client.models.list().data[0].id, prompt="JSON:", max_tokens=160,
                                    temperature=0, extra_body={"response_format": {"type": "json_object"}})
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].text), dict)
    else:  # a random tiny model may wander in an open object: it must end as "length", never a silent cut
        assert out.choices[0].finish_reason == "length"


@pytest.mark.parametrize("kind", ["regex", "ebnf", "json_schema"])
def test_generate_pd_equals_colocated(cluster: Cluster, kind: str) -> None:
    body = {"input_ids": [5, 17, 99, 42, 8], "sampling_params": {"max_new_tokens": 40, "temperature": 0,
                                                                  kind: CONSTRAINTS[kind]}}
    pd = httpx.post(cluster.router.url + "/generate", json=body, timeout=120).json()
    colo = httpx.post(cluster.colocated.url + "/generate", json=body, timeout=120).json()
    assert pd["output_ids"] == colo["output_ids"] and pd["output_ids"]
    assert pd["meta_info"]["finish_reason"] == colo["meta_info"]["finish_reason"]


def test_bad_specs_are_400_before_any_worker(cluster: Cluster, client: openai.OpenAI) -> None:
    before = cluster.pair.decode.stat("grammar_compile_errors_total") or 0.0
    with pytest.raises(openai.BadRequestError, match="objectx"):
        client.chat.completions.create(
            model=client.models.list().data[0].id, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}})
    for kind, text, words in [("regex", "(ab", "parenthesis"), ("ebnf", "root ::= foo", "foo"),
                              ("json_schema", "{\"type\":", "not valid JSON")]:
        r = httpx.post(cluster.router.url + "/generate", json={"text": "hi", "sampling_params": {kind: text}},
                       timeout=60)
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
        # the instances' own frontends refuse it too (engine compile error -> 400)
        r = httpx.post(cluster.colocated.url + "/generate", json={"text": "hi", "sampling_params": {kind: text}},
                       timeout=60)
        assert r.status_code == 400 and words in r.text, r.text
    assert (cluster.pair.decode.stat("grammar_compile_errors_total") or 0.0) == before
