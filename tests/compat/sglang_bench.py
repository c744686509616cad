"""SGLang's own benchmark client (`python -m sglang.bench_serving`), unchanged, without SGLang's runtime.

`pip download --no-deps sglang==VERSION` gives the wheel (cached under ~/.cache/pdserve); its
`sglang/bench_serving.py` and `sglang/benchmark/` are extracted as they are. What else the
client imports is the serving runtime (not installed here), stubbed with the few names it uses:
`sglang/__init__.py` (empty), `sglang.srt.disaggregation.utils.FAKE_BOOTSTRAP_HOST`,
`sglang.srt.utils.network.resolve_base_url / resolve_host_port`, and `pybase64` (image datasets
only; the tests use the random dataset).
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

SGLANG_VERSION = "0.5.23"
CACHE = Path.home() / ".cache" / "pdserve" / f"sglang-{SGLANG_VERSION}"

STUBS = {
    "sglang/__init__.py": "",
    "sglang/srt/__init__.py": "",
    "sglang/srt/disaggregation/__init__.py": "",
    "sglang/srt/disaggregation/utils.py": 'FAKE_BOOTSTRAP_HOST = "2.2.2.2"\n',
    "sglang/srt/utils/__init__.py": "",
    "sglang/srt/utils/network.py": (
        "def resolve_base_url(base_url, host, port):\n"
        "    return base_url or f'http://{host}:{port}'\n\n\n"
        "def resolve_host_port(base_url, host, port):\n"
        "    return base_url or f'{host}:{port}'\n"
    ),
    "pybase64.py": "from base64 import b64decode, b64encode  # noqa: F401\n",
}


def bench_serving_root() -> Path:
    """A directory to put on PYTHONPATH so that `python -m sglang.bench_serving` runs."""
    root = CACHE / "root"
    if (root / "sglang" / "bench_serving.py").exists():
        return root
    CACHE.mkdir(parents=True, exist_ok=True)
    wheels = list(CACHE.glob("sglang-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", f"sglang=={SGLANG_VERSION}",
                        "-d", str(CACHE)], check=True, timeout=600)
        wheels = list(CACHE.glob("sglang-*.whl"))
    with zipfile.ZipFile(wheels[0]) as wheel:
        for name in wheel.namelist():
            if name == "sglang/bench_serving.py" or name.startswith("sglang/benchmark/"):
                wheel.extract(name, root)
    for rel, text in STUBS.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


# The client's own command line (cli_main, as `python -m sglang.bench_serving` runs it), several
# runs in one process (importing the client: transformers, torch, datasets, ~13 s of CPU, paid
# once). `python -c DRIVER '{name: client argv}'`: each run's status ("ok" or a traceback) goes
# to <name>.status in the working directory, so one run's failure leaves the others judged.
DRIVER = """
import json, sys, traceback
from pathlib import Path
import sglang.bench_serving as bench
for name, argv in json.loads(sys.argv[1]).items():
    sys.argv = ["sglang.bench_serving", *argv]
    try:
        bench.cli_main()
        status = "ok"
    except BaseException:
        status = traceback.format_exc()
    Path(name + ".status").write_text(status)
"""
