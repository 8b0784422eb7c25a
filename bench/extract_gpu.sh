#!/usr/bin/env bash
# Extract, calibrate and evaluate the two interventions for a local checkpoint on one GPU.
#
#   bench/extract_gpu.sh /models/Llama-3.2-3B [OUT_ROOT] [VERSION]
#
# Needs a CUDA build of vLLM + torch in the active environment (the CPU venv of this repo will
# not do) and the weights in a local folder (steerserve never downloads weights).
# Layer choices are for a 28-layer model (Llama-3.2-3B): recall ~ blocks 6-16 (before the English
# answer forms, paper: ~10), translation ~ 18-26 (late, where the target language takes over).
set -euo pipefail

MODEL=${1:?usage: $0 MODEL_DIR [OUT_ROOT] [VERSION]}
OUT=${2:-out/$(basename "$MODEL")}
VERSION=${3:-v1}
SLUG=$(basename "$MODEL" | tr '[:upper:]' '[:lower:]')
ART=vectors/$SLUG/$VERSION
PY=${PYTHON:-python}
mkdir -p "$OUT"
log() { echo "[$(date -u +%H:%M:%S)] $*"; }

python_has_cuda=$($PY -c 'import torch; print(torch.cuda.is_available())')
[ "$python_has_cuda" = "True" ] || { echo "no CUDA device visible to torch" >&2; exit 2; }

t0=$(date +%s)
log "extract ($MODEL, bfloat16, all layers)"
$PY -m steerserve extract --model "$MODEL" --device cuda --dtype bfloat16 \
  --per-lang 64 --batch-size 32 --out "$OUT/candidates.safetensors"
t1=$(date +%s)

log "calibrate (joint sweep by Δ log P(gold) on one half of the calibration split, re-checked on the other)"
$PY -m steerserve calibrate --model "$MODEL" --candidates "$OUT/candidates.safetensors" \
  --out "$ART" --overwrite --device cuda --dtype bfloat16 --batch-size 32 \
  --per-lang 40 --en-items 40 --holdout 40 \
  --recall-layers 6,8,10,12,14,16 --recall-scales 0.05,0.1,0.25,0.5,1.0 \
  --translation-layers 18,20,22,24,26 --translation-scales 0.05,0.1,0.25,0.5,1.0 \
  --positions last_prompt_and_generated,all --summary-dir "$OUT"
t2=$(date +%s)

log "eval (held-out test split, all arms)"
$PY -m steerserve eval --model "$MODEL" --artifact "$ART" --out "$OUT/eval" \
  --dtype bfloat16 --kv-cache-bytes 0 --max-num-seqs 256
t3=$(date +%s)

$PY -m steerserve vectors verify "$ART" --model "$MODEL"
log "times (s): extract $((t1 - t0)), calibrate $((t2 - t1)), eval $((t3 - t2))"
log "artifact $ART; report $OUT/eval/report.md"
