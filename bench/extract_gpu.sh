#!/usr/bin/env bash
# The paper's model on one GPU: one `steerserve tune` (extract, calibrate, confirm, gate, test,
# publish), timed per stage in its report.
#
#   bench/extract_gpu.sh /models/Llama-3.2-3B [VERSION]
#
# Needs a CUDA build of vLLM + torch in the active environment (the CPU venv of this repo will
# not do) and the weights in a local folder (steerserve never downloads weights). Layer choices
# are for a 28-layer model (Llama-3.2-3B): recall ~ blocks 6-16, translation ~ 18-26.
set -euo pipefail

MODEL=${1:?usage: $0 MODEL_DIR [VERSION]}
VERSION=${2:-v1}
SLUG=$(basename "$MODEL" | tr '[:upper:]' '[:lower:]')
PY=${PYTHON:-python}

[ "$($PY -c 'import torch; print(torch.cuda.is_available())')" = "True" ] \
  || { echo "no CUDA device visible to torch" >&2; exit 2; }

exec $PY -m steerserve tune --model "$MODEL" --device cuda --out "vectors/$SLUG/$VERSION" \
  --extract-per-lang 64 \
  --recall-layers 6,8,10,12,14,16 --recall-scales 0.05,0.1,0.25,0.5,1.0 \
  --translation-layers 18,20,22,24,26 --translation-scales 0.05,0.1,0.25,0.5,1.0 \
  --positions last_prompt_and_generated,all
