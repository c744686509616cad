#!/usr/bin/env bash
# Installs the project into .venv (see install.sh), lints, type-checks and runs the test suite:
# the unit tier first (in-process, ~1 min on 2 cores; stops here on a failure), then the process
# and reliability tiers. With arguments, runs pytest once with them instead:
#   launch/test.sh -m "unit and not slow"   the quick loop
#   launch/test.sh tests/pd -k e2e  a selection
set -euo pipefail
cd "$(dirname "$0")/.."
# The install skips pip's byte-compiling (install.sh): each module is compiled on its first import
# and cached, which PYTHONDONTWRITEBYTECODE=1 (set in some shells and images) would turn into a
# compile in every one of the suite's hundreds of processes (import torch: 2.6 -> 5.4 s of CPU).
unset PYTHONDONTWRITEBYTECODE
PDSERVE_PIP_NO_COMPILE=1 bash launch/install.sh
echo "== install: $SECONDS s"
.venv/bin/ruff check common router prefill_server decode_server kv_transfer bench tests
# One mypy cache per machine, not per checkout: a fresh clone re-checks only what differs from the
# last run here (~50 s of CPU cold, as on a fresh CI machine; 1 s warm); mypy validates by hash.
typecheck() { MYPY_CACHE_DIR=${MYPY_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pdserve/mypy} .venv/bin/mypy; }
if [ $# -gt 0 ]; then
  typecheck
  exec .venv/bin/python -m pytest -q -x "$@"
fi
# mypy runs beside the unit tier (one process of pure CPU work; the unit tier's two workers leave
# ~0.35 of the 2 cores idle, waiting on sockets and NIXL timeouts) and is judged when it ends.
mypy_log=$(mktemp)
typecheck >"$mypy_log" 2>&1 &
mypy_pid=$!
trap 'kill $mypy_pid 2>/dev/null || true; rm -f "$mypy_log"' EXIT
tier() {
  local start=$SECONDS starts
  starts=$(mktemp)
  echo "== tier: $1"
  PDSERVE_TEST_START_LOG=$starts .venv/bin/python -m pytest -q -x --durations=15 -m "$@"
  echo "== tier $1: $((SECONDS - start)) s; process starts by kind:" $(cut -f1 "$starts" | sort | uniq -c | sort -rn)
  rm -f "$starts"
}
# xdist workers, whole files each (module-scoped fixtures stay in one process): a serial tier
# waits on process starts, sockets and compiles much of its time (2 workers on 2 cores: unit
# 92 -> 49 s, proc 709 -> 546 s). One worker per core, 2 to 4 (a bigger CI box needs no change).
# The reliability tier shares one cluster and stays serial. `slow` tests (the real default
# model) run in their file's tier; `-m "unit and not slow"` is the quick loop.
workers=$(nproc)
workers=$((workers < 2 ? 2 : workers > 4 ? 4 : workers))
tier "unit" -n "$workers" --dist loadfile
mypy_rc=0
wait $mypy_pid || mypy_rc=$?
echo "== mypy (beside the unit tier): rc $mypy_rc"
cat "$mypy_log"
[ $mypy_rc -eq 0 ]
tier "proc" -n "$workers" --dist loadfile
tier "reliability"
echo "== launch/test.sh: $SECONDS s in all"
