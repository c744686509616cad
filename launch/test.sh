#!/usr/bin/env bash
# Installs the project into .venv (see install.sh), lints, type-checks and runs the test suite:
# the unit tier first (in-process, ~1 min on 2 cores; stops here on a failure), then the process
# and reliability tiers. With arguments, runs pytest once with them instead:
#   launch/test.sh -m "unit and not slow"   the quick loop
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
  .venv/bin/python -m pytest -q -x --durations=15 -m "$@"
  echo "== tier $1: $((SECONDS - start)) s"
}
# Two workers, whole files each (module-scoped fixtures stay in one process): a serial tier
# waits on process starts, sockets and compiles much of its time (unit 92 -> 49 s, proc 709 ->
# 546 s). The reliability tier shares one cluster and stays serial. `slow` tests (the real
# default model) run in their file's tier; `-m "unit and not slow"` is the quick loop.
tier "unit" -n 2 --dist loadfile
tier "proc" -n 2 --dist loadfile
tier "reliability"
