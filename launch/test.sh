#!/usr/bin/env bash
# Installs the project into .venv (see install.sh), lints, type-checks and runs the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/install.sh
.venv/bin/ruff check common router prefill_server decode_server kv_transfer bench tests
.venv/bin/mypy
.venv/bin/python -m pytest -q -x "$@"
