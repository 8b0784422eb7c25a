#!/usr/bin/env bash
# GPU checks of the steering plugin (what CPU tests cannot show): the op alone on PyTorch
# (bench/gpu_op_check.py), then Model Runner V2 and V1 with compiled forward + CUDA graphs, mixed
# batches at, between and above capture sizes, the transformers oracle on CUDA, no host syncs in the
# step, and stock vs steerserve both compiled (bench/overhead.py: idle/stock, add/idle,
# ablate/idle with intervals) on MODEL and on COMPILED_MODEL.
# Needs: one NVIDIA GPU, Python 3.11/3.12, access to PyPI (installs the CUDA build of vLLM 0.33.0)
# unless VENV already holds it.
#   bash bench/gpu_check.sh                     # results in out/gpu/
#   ONLY=compiled bash bench/gpu_check.sh       # the compiled comparison alone (< 8 min on an H100)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-gpu}
OUT=${OUT:-out/gpu}
MODEL=${MODEL:-default}   # any local HF folder of a supported architecture for the overhead run
# the compiled comparison's checkpoint: a local <= 3B folder, or tiny (random, built offline)
COMPILED_MODEL=${COMPILED_MODEL:-tiny}
ONLY=${ONLY:-}            # "compiled": run bench/overhead.py on COMPILED_MODEL only
mkdir -p "$OUT"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q 'vllm==0.33.0'
  "$VENV/bin/pip" install -q -e '.[dev]'
fi
PY="$VENV/bin/python"
export PYTHONUNBUFFERED=1
status=0
compiled() {  # 3 rounds x 2 engine starts; the timeout keeps one device call under 8 minutes
  timeout 470 "$PY" bench/overhead.py --model "$COMPILED_MODEL" --kv-cache-bytes 0 --rounds 3 \
    --tokens 128 --out "$OUT/compiled.json" 2>&1 | tee "$OUT/compiled.log"
}
if [ "$ONLY" = compiled ]; then
  compiled || status=1
  exit $status
fi
"$PY" bench/gpu_op_check.py --out "$OUT" 2>&1 | tee "$OUT/op.log" || status=1
"$PY" bench/gpu_check.py --runner v2 --out "$OUT" 2>&1 | tee "$OUT/v2.log" || status=1
VLLM_USE_V2_MODEL_RUNNER=0 "$PY" bench/gpu_check.py --runner v1 --out "$OUT" 2>&1 | tee "$OUT/v1.log" || status=1
# Any device->host sync inside a step is an error (steering must not add one).
VLLM_GPU_SYNC_CHECK=error "$PY" bench/gpu_check.py --runner v2 2>&1 | tee "$OUT/sync.log" || status=1
grep -h "active runner" "$OUT"/v2.log "$OUT"/v1.log || true
"$PY" bench/overhead.py --model "$MODEL" --kv-cache-bytes 0 --concurrency 64 --tokens 128 \
  --out "$OUT/overhead.json" 2>&1 | tee "$OUT/overhead.log" || status=1
compiled || status=1
exit $status
