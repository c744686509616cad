"""The wheel, as a user installs it: built from the source (not the editable install), installed into
a fresh venv, run from outside the checkout. Its console scripts start and print the wheel's own
version, it holds every module and data file of the packages, and an instance plus a router started
by `pdserve-server` / `pdserve-router` from it serve a json_schema request (xgrammar present)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest

from common.cli import ROLES
from tests.harness.process import REPO_ROOT
from tests.packaging.serving import Launch, Serving, serving
from tests.packaging.wheel_env import (
    PACKAGES,
    TEST_VERSION_LABEL,
    InstalledWheel,
    build_wheel,
    entry_points,
    install_wheel,
    wheel_names,
)

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> InstalledWheel:
    root = tmp_path_factory.mktemp("wheel")
    wheel, version = build_wheel(root)
    return install_wheel(wheel, version, root)


def test_imports_come_from_the_wheel(installed: InstalledWheel) -> None:
    code = ("import importlib, json; print(json.dumps({m: importlib.import_module(m).__file__ for m in "
            f"{[*PACKAGES, 'common.version', 'common.cli']!r}}}))")
    out = installed.run([str(installed.bin / "python"), "-c", code])
    assert out.returncode == 0, out.stderr
    for module, path in json.loads(out.stdout).items():
        assert Path(path).is_relative_to(installed.site_packages), (module, path)


def test_wheel_holds_every_package_file_and_nothing_else(installed: InstalledWheel) -> None:
    names = wheel_names(installed.wheel)
    expected = {p.relative_to(REPO_ROOT).as_posix() for pkg in PACKAGES for p in (REPO_ROOT / pkg).rglob("*")
                if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}
    assert expected <= names, sorted(expected - names)  # a data file the code opens would be missing here
    top = {n.split("/")[0] for n in names}
    assert top == {*PACKAGES, f"pdserve-{installed.version}.dist-info"}, top  # no tests/, bench/, launch/


def test_console_scripts_start(installed: InstalledWheel) -> None:
    scripts = entry_points(installed.wheel)
    for role in ROLES.values():
        assert f"{role.script} = {role.module}.__main__:main" in scripts
        out = installed.run([str(installed.bin / role.script), "--version"])
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith(f"pdserve {installed.version} ("), out.stdout
    assert installed.version.endswith(TEST_VERSION_LABEL)  # the wheel's metadata, not the checkout's pyproject
    out = installed.run([str(installed.bin / "pdserve"), "--version"])
    assert (out.returncode, out.stdout) == (0, f"pdserve {installed.version}\n"), out
    for module in ("router", "prefill_server"):  # `python -m ROLE`, what the chart's pods and launch/pd.sh run
        out = installed.run([str(installed.bin / "python"), "-m", module, "--version"])
        assert out.returncode == 0 and out.stdout.startswith(f"pdserve {installed.version} ("), out
    out = installed.run([str(installed.bin / "pdserve-router"), "--help"])
    assert out.returncode == 0 and "--model-path" in out.stdout and "--prefill" in out.stdout, out
    out = installed.run([str(installed.bin / "pdserve"), "decode", "--help"])
    assert out.returncode == 0 and "--disaggregation-mode" in out.stdout, out


@pytest.fixture(scope="module")
def wheel_serving(installed: InstalledWheel, tiny_llama_path: str) -> Iterator[Serving]:
    launch = Launch(router=[str(installed.bin / "pdserve-router")], server=[str(installed.bin / "pdserve-server")],
                    cwd=installed.workdir, pythonpath=None, env={"PYTHONPATH": ""})
    with serving(launch, tiny_llama_path) as s:
        yield s


def test_installed_wheel_serves_json_schema(wheel_serving: Serving) -> None:
    model = httpx.get(wheel_serving.router_url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "a number"}], "max_tokens": 40,
            "temperature": 0, "response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "n", "schema": SCHEMA}}}
    r = wheel_serving.post(wheel_serving.router_url, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":  # a random tiny model may run out of tokens inside the number
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    else:
        assert choice["finish_reason"] == "length" and choice["message"]["content"].startswith('{"n": ')
    # and a bad schema is the router's 400 (its checker process, spawned from the console script)
    body["response_format"]["json_schema"]["schema"] = {"type": "objectx"}
    r = wheel_serving.post(wheel_serving.router_url, "/v1/chat/completions", body)
    assert r.status_code == 400 and "objectx" in r.json()["error"]["message"], r.text
