# syntax=docker/dockerfile:1
# steerserve, GPU image: the CUDA build of vLLM + steerserve + the shipped steering vectors.
#
#   docker build -t steerserve:gpu .
#   docker run --gpus all --shm-size 8g -p 8000:8000 \
#     -v /srv/models/my-model:/models/model:ro steerserve:gpu
#
# --shm-size: vLLM's processes share ring buffers in /dev/shm (and NCCL between tensor-parallel
# workers); Docker's default 64 MB is too small.
#
# Weights are mounted at /models/model (STEERSERVE_MODEL), or baked in at build time with
# --build-arg MODEL_ID=<hub id> (and --secret id=hf_token,env=HF_TOKEN for gated models).
# The CPU variant is deploy/Dockerfile.cpu. Variables, sizing, compose and Kubernetes: deploy/README.md.

# vLLM 0.33 runs on torch 2.14 built for CUDA 13: the host driver must support CUDA 13.
ARG CUDA_IMAGE=nvidia/cuda:13.0.0-runtime-ubuntu24.04

# ---- builder: the steerserve wheel (pure Python). Its build tooling stays in this stage. ----
FROM python:3.12-slim AS builder
WORKDIR /src
COPY . .
RUN python -m pip wheel --no-deps --no-cache-dir --wheel-dir /wheels . \
    && mkdir -p /src/vectors

# ---- runtime ----
FROM ${CUDA_IMAGE} AS runtime

# Triton (inside torch and vLLM) compiles its small launcher modules at run time, on the first
# model load: it needs a C compiler, the libc headers and Python.h. They are the only
# compile-time packages in this stage, and nothing is built with them at image build time.
# Versions come from the pinned base image's Ubuntu release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev gcc libc6-dev libnuma1 ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 steerserve \
    && useradd --system --uid 10001 --gid steerserve --create-home \
        --home-dir /home/steerserve steerserve \
    && mkdir -p /app /models \
    && chown 10001:10001 /app /models

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# `[gpu]` is vllm==0.33.0 (CUDA); `[postgres]` the driver of the PostgreSQL experiment store. Ray is vLLM's multi-node executor (deploy/k8s/multinode-ray.yaml);
# build with --build-arg RAY_REQUIREMENT= to leave it out of a single-node image.
ARG RAY_REQUIREMENT="ray[default]==2.60.0"
# Both are pinned: the wheel's `gpu` extra says vllm==0.33.0, RAY_REQUIREMENT says its version.
# hadolint ignore=DL3013
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    python3 -m venv /opt/venv \
    && set -- /wheels/steerserve-*.whl \
    && pip install "$1[gpu,postgres]" ${RAY_REQUIREMENT:+"$RAY_REQUIREMENT"}

COPY --from=builder --chown=10001:10001 /src/vectors /app/vectors

USER 10001:10001
WORKDIR /app
ENV HOME=/home/steerserve \
    HF_HOME=/home/steerserve/.cache/huggingface \
    STEERSERVE_MODEL=/models/model \
    STEERSERVE_VECTORS_DIR=/app/vectors \
    STEERSERVE_HOST=0.0.0.0 \
    STEERSERVE_PORT=8000 \
    STEERSERVE_GPU_MEMORY_UTILIZATION=0.9 \
    STEERSERVE_STEERING=off

# Optional: bake weights into the image (otherwise mount them at /models/model).
ARG MODEL_ID=""
ARG MODEL_REVISION=main
RUN --mount=type=secret,id=hf_token,env=HF_TOKEN \
    if [ -n "${MODEL_ID}" ]; then \
        hf download "${MODEL_ID}" --revision "${MODEL_REVISION}" --local-dir /models/model \
        && rm -rf /models/model/.cache "${HF_HOME}"; \
    fi

EXPOSE 8000
# Liveness only (/health): readiness (/ready) is for load balancers. Loading a large model takes
# minutes, hence the start period.
HEALTHCHECK --interval=30s --timeout=5s --start-period=10m --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('STEERSERVE_PORT', '8000'), timeout=4)"]

ENTRYPOINT ["steerserve", "serve"]
