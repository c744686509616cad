#!/usr/bin/env bash
# Installs the project into .venv (see install.sh), lints, type-checks and runs the test suite:
# the unit tier first (in-process, ~4 min on 2 cores; stops here on a failure), then the process,
# reliability and slow tiers. With arguments, runs pytest once with them instead:
#   launch/test.sh -m unit          the quick loop
#   launch/test.sh tests/pd -k e2e  a selection
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/install.sh
.venv/bin/ruff check common router prefill_server decode_server kv_transfer bench tests
.venv/bin/mypy
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest -q -x "$@"
fi
tier() {
  local start=$SECONDS
  echo "== tier: $1"
  .venv/bin/python -m pytest -q -x --durations=8 -m "$1"
  echo "== tier $1: $((SECONDS - start)) s"
}
tier "unit and not slow"
tier "proc and not slow"
tier "reliability and not slow"
tier "slow"
