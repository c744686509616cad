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
  .venv/bin/python -m pytest -q -x --durations=15 -m "$@"
  echo "== tier $1: $((SECONDS - start)) s"
}
tier "unit and not slow"
# Two workers, whole files each (module-scoped clusters stay in one process): the tier waits on
# process starts and sockets ~40% of its time serially, and fills both cores this way (709 ->
# 546 s). The reliability tier stays serial: two of its load/kill files at once were slower.
tier "proc and not slow" -n 2 --dist loadfile
tier "reliability and not slow"
tier "slow"
