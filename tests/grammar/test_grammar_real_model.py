"""The default model (SmolLM2-135M-Instruct) through router + 1P1D with the openai client: N
schemas x M prompts (nested objects, enums, arrays, bounded numbers), every answer json.loads and
validates with jsonschema; regex and EBNF through /generate. Slow: three processes on the real
model (started once for the module)."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from tests.harness.process import stop_all
from tests.pd.pd_procs import PDPair, start_pair
from tests.router.router_procs import RouterProc

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from structured_workload import PROMPTS, SCHEMAS, chat_messages  # noqa: E402

pytestmark = pytest.mark.slow
# 8k tokens of KV (~360 MiB in float32) instead of the default 1 GiB in each instance: the
# module's most in flight is its concurrent schema cases, a few hundred tokens each.
POOL = ["--max-total-tokens", "8192"]


@pytest.fixture(scope="module")
def real_pd(default_model_path: str) -> Iterator[tuple[RouterProc, PDPair]]:
    model = Path(default_model_path)
    pair = start_pair(model, POOL, POOL)
    router = None
    try:
        router = RouterProc(model, ["--prefill", pair.prefill.url, str(pair.prefill.bootstrap_port),
                                    "--decode", pair.decode.url])
        router.wait_ready(timeout=120)
        yield router, pair
        pair.wait_whole()
    finally:
        stop_all([p.child for p in (router, pair.prefill, pair.decode) if p is not None])


def test_schemas_x_prompts_all_validate(real_pd: tuple[RouterProc, PDPair]) -> None:
    router, _ = real_pd
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0, timeout=300)
    cases = [(kind, p) for kind in SCHEMAS for p in PROMPTS[:2]]
    name = client.models.list().data[0].id

    def ask(case: tuple[str, str]) -> str:
        kind, prompt = case
        out = client.chat.completions.create(
            model=name, messages=chat_messages(kind, prompt), max_tokens=200, temperature=0,  # type: ignore[arg-type]
            response_format={"type": "json_schema", "json_schema": {"name": kind, "schema": SCHEMAS[kind]}})
        assert out.choices[0].finish_reason == "stop", (case, out.choices[0])
        return out.choices[0].message.content or ""

    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(ask, cases))
    for (kind, _), text in zip(cases, answers, strict=True):
        jsonschema.validate(json.loads(text), SCHEMAS[kind])


def test_regex_and_ebnf_through_generate(real_pd: tuple[RouterProc, PDPair]) -> None:
    router, _ = real_pd
    cases = [("regex", r"[A-Z][a-z]+, [0-9]{4}", r"[A-Z][a-z]+, [0-9]{4}"),
             ("ebnf", 'root ::= "The answer is " ("yes" | "no") "."', r"The answer is (yes|no)\.")]
    for kind, spec, pattern in cases:
        body = {"text": "Name a city and a year: ", "sampling_params": {"max_new_tokens": 32, "temperature": 0,
                                                                        kind: spec}}
        out = httpx.post(router.url + "/generate", json=body, timeout=300).json()
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        assert re.fullmatch(pattern, out["text"]), out["text"]
