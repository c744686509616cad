"""A feature whose optional package is missing is refused clearly, never a 500: with xgrammar
unimportable in every process (as after a plain `pip install pdserve`), a structured-output request,
valid or not, gets 501 naming the package and the command that installs it, on the router's OpenAI
endpoints and /generate and on the instance's own /generate; unconstrained requests are still served."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from common.optional_packages import MISSING_PACKAGE_CODE, XGRAMMAR
from tests.harness.process import REPO_ROOT
from tests.packaging.serving import Launch, Serving, hide_xgrammar, serving

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
BAD_SCHEMA = {"type": "objectx"}  # with xgrammar present: a 400 naming "objectx"


@pytest.fixture(scope="module")
def no_xgrammar(tiny_llama_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serving]:
    hidden = hide_xgrammar(tmp_path_factory.mktemp("no_xgrammar"))
    launch = Launch(router=[sys.executable, "-m", "router"], server=[sys.executable, "-m", "common.server"],
                    pythonpath=os.pathsep.join([str(hidden), str(REPO_ROOT)]))
    with serving(launch, tiny_llama_path) as s:
        yield s


def assert_names_the_package(r: httpx.Response, where: str) -> None:
    assert r.status_code == 501, (r.status_code, r.text)
    error = r.json()["error"]
    assert "'xgrammar'" in error["message"] and XGRAMMAR.install in error["message"], error
    assert f"this {where}'s environment" in error["message"], error
    assert "hidden by tests/packaging" not in error["message"]  # the ImportError's words go to the log only


def chat(schema: dict[str, object]) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


@pytest.mark.parametrize("schema", [SCHEMA, BAD_SCHEMA], ids=["valid", "invalid"])
def test_router_openai_refuses_naming_the_package(no_xgrammar: Serving, schema: dict[str, object]) -> None:
    models = httpx.get(no_xgrammar.router_url + "/v1/models", timeout=10).json()["data"]
    body = {**chat(schema), "model": models[0]["id"]}
    r = no_xgrammar.post(no_xgrammar.router_url, "/v1/chat/completions", body)
    assert_names_the_package(r, "router")
    assert r.json()["error"]["code"] == MISSING_PACKAGE_CODE and r.json()["error"]["param"] == "response_format"
    r = no_xgrammar.post(no_xgrammar.router_url, "/v1/completions", {
        "model": models[0]["id"], "prompt": "JSON:", "max_tokens": 4, "response_format": {"type": "json_object"}})
    assert_names_the_package(r, "router")


@pytest.mark.parametrize("kind,text", [("json_schema", json.dumps(SCHEMA)), ("json_schema", json.dumps(BAD_SCHEMA)),
                                       ("regex", "(ab"), ("ebnf", 'root ::= "a"')])
def test_generate_refuses_naming_the_package(no_xgrammar: Serving, kind: str, text: str) -> None:
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 4, kind: text}}
    assert_names_the_package(no_xgrammar.post(no_xgrammar.router_url, "/generate", body), "router")
    # the instance's own frontend: its engine could not compile it
    assert_names_the_package(no_xgrammar.post(no_xgrammar.instance_url, "/generate", body), "instance")


def test_unconstrained_requests_are_still_served(no_xgrammar: Serving) -> None:
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    for base in (no_xgrammar.router_url, no_xgrammar.instance_url):
        r = no_xgrammar.post(base, "/generate", body)
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4, r.text


@pytest.fixture(scope="module")
def worker_without_xgrammar(tiny_llama_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serving]:
    """The router's host has xgrammar, the instance's does not (installed apart)."""
    hidden = hide_xgrammar(tmp_path_factory.mktemp("no_xgrammar_worker"))
    launch = Launch(router=[sys.executable, "-m", "router"], server=[sys.executable, "-m", "common.server"],
                    server_pythonpath=os.pathsep.join([str(hidden), str(REPO_ROOT)]))
    with serving(launch, tiny_llama_path) as s:
        yield s


def test_a_worker_without_the_package_is_named_through_the_router(worker_without_xgrammar: Serving) -> None:
    s = worker_without_xgrammar
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 4, "json_schema": json.dumps(SCHEMA)}}
    assert_names_the_package(s.post(s.router_url, "/generate", body), "instance")  # the worker's 501, relayed
    models = httpx.get(s.router_url + "/v1/models", timeout=10).json()["data"]
    r = s.post(s.router_url, "/v1/chat/completions", {**chat(SCHEMA), "model": models[0]["id"]})
    assert_names_the_package(r, "instance")
    # the router can still check a schema itself: an invalid one is its 400, before the worker
    r = s.post(s.router_url, "/v1/chat/completions", {**chat(BAD_SCHEMA), "model": models[0]["id"]})
    assert r.status_code == 400 and "objectx" in r.json()["error"]["message"], r.text


def test_the_hiding_works(tmp_path: Path) -> None:
    """The stub really makes xgrammar unimportable (else the tests above prove nothing)."""
    hidden = hide_xgrammar(tmp_path)
    code = "from common.optional_packages import XGRAMMAR; print(XGRAMMAR.import_problem())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(hidden), str(REPO_ROOT)])})
    assert out.stdout.startswith("ModuleNotFoundError: No module named 'xgrammar'"), out
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert out.stdout.strip() == "None", out  # and unhidden it imports (this venv has it)
