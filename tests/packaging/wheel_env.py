"""Build pdserve's wheel from a copy of the source and install it into a fresh venv, as a user's
`pip install dist/*.whl` would, without downloading anything: the new venv sees this venv's
site-packages (torch, xgrammar, ...) through a .pth line, so only pdserve itself comes from the
wheel. That line adds the directory alone (no .pth processing there), so this venv's editable
install of pdserve stays inactive in the new one; `InstalledWheel.check_imports` proves it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tests.harness.process import REPO_ROOT

PACKAGES = ("common", "router", "prefill_server", "decode_server", "kv_transfer")  # pyproject's packages.find
SOURCE_FILES = ("pyproject.toml", "README.md")  # what the build reads besides the packages
TEST_VERSION_LABEL = "+wheeltest"  # appended to the copy's version: --version must show the wheel's own
BUILD_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class InstalledWheel:
    wheel: Path
    version: str  # the version the wheel was built with
    prefix: Path  # the new venv
    workdir: Path  # a cwd outside the checkout

    @property
    def bin(self) -> Path:
        return self.prefix / "bin"

    @property
    def site_packages(self) -> Path:
        return Path(sysconfig.get_path("purelib", vars={"base": str(self.prefix), "platbase": str(self.prefix)}))

    def env(self) -> dict[str, str]:
        """os.environ without anything that points Python at the checkout."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
        env["PATH"] = f"{self.bin}{os.pathsep}{env.get('PATH', '')}"
        return env

    def run(self, argv: list[str], timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, cwd=self.workdir, env=self.env())


def _copy_source(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for pkg in PACKAGES:
        shutil.copytree(REPO_ROOT / pkg, dest / pkg, ignore=ignore)
    for name in SOURCE_FILES:
        shutil.copy2(REPO_ROOT / name, dest / name)


def _label_version(pyproject: Path) -> str:
    text = pyproject.read_text()
    m = re.search(r'^version = "([^"]+)"$', text, re.MULTILINE)
    assert m is not None, "pyproject.toml has no version line"
    labelled = m.group(1) + TEST_VERSION_LABEL
    pyproject.write_text(text[:m.start(1)] + labelled + text[m.end(1):])
    return labelled


def build_wheel(root: Path) -> tuple[Path, str]:
    """pdserve's wheel (built offline with this venv's setuptools) and its version."""
    src, dist = root / "src", root / "dist"
    _copy_source(src)
    version = _label_version(src / "pyproject.toml")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "-q", "-w", str(dist), str(src)], check=True, timeout=BUILD_TIMEOUT_S, cwd=root)
    (wheel,) = dist.glob("pdserve-*.whl")
    return wheel, version


def install_wheel(wheel: Path, version: str, root: Path) -> InstalledWheel:
    prefix = root / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(prefix)
    inst = InstalledWheel(wheel, version, prefix, root / "work")
    inst.workdir.mkdir()
    # dependencies: this venv's, as a plain path (its .pth files, the editable pdserve's among them, stay off)
    (inst.site_packages / "_pdserve_test_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(prefix / "bin" / "python"), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, timeout=BUILD_TIMEOUT_S, cwd=inst.workdir)
    return inst


def wheel_names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())


def entry_points(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt")]
        return z.read(name).decode()
