"""/openapi.json on the router and on every instance (/docs on instances, the router's is opt-in), generated from the msgspec types;
the documents pass an OpenAPI validator, and schemathesis fuzzes the router's without a 5xx."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from openapi_spec_validator import validate

from tests.compat.cluster import Cluster

MAX_EXAMPLES = 50  # per operation, seeded: all 6 operations, ~150 requests (100: 303 requests, 212 s; 50: 7 s)


def test_documents_are_valid_openapi(cluster: Cluster) -> None:
    urls = {"router": cluster.router.url, "prefill": cluster.pair.prefill.url, "decode": cluster.pair.decode.url,
            "colocated": cluster.colocated.url}
    for name, url in urls.items():
        doc = httpx.get(url + "/openapi.json", timeout=10).json()
        validate(doc)
        gen = doc["paths"]["/generate"]["post"]
        ref = gen["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        body = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]["properties"]
        assert {"text", "input_ids", "sampling_params", "logprob_start_len", "lora_path"} <= set(body), name
        docs = httpx.get(url + "/docs", timeout=10)
        if name == "router":  # its Swagger UI loads a CDN script: only with --enable-docs
            assert docs.status_code == 404, docs.text
        else:
            assert docs.status_code == 200 and "swagger" in docs.text.lower(), name
    router_doc = httpx.get(cluster.router.url + "/openapi.json", timeout=10).json()
    assert {"/v1/completions", "/v1/chat/completions", "/generate", "/v1/models"} <= set(router_doc["paths"])


def test_schemathesis_finds_no_server_error(cluster: Cluster, tmp_path: Path) -> None:
    argv = [str(Path(sys.executable).parent / "schemathesis"), "run", cluster.router.url + "/openapi.json",
            "--checks", "not_a_server_error", "--max-examples", str(MAX_EXAMPLES), "--phases", "fuzzing",
            "--request-timeout", "60", "--workers", "2", "--seed", "15"]
    if not Path(argv[0]).exists():
        pytest.skip("schemathesis is not installed (the test extra installs it)")
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=540, cwd=tmp_path,
                          env={**os.environ, "NO_COLOR": "1"})
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
