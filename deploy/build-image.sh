#!/usr/bin/env bash
# Build the CPU image (deploy/Dockerfile.cpu) and check it the way a new user runs it.
#
#   deploy/build-image.sh              build, run, check, stop; exit 0 only if every step passed
#   deploy/build-image.sh base         only make the local base image (podman + mmdebstrap)
#   deploy/build-image.sh plan         print the build command and the run line, build nothing
#   SKIP_BUILD=1 deploy/build-image.sh check an image built before
#
# 1. Engine: ENGINE, else docker when its daemon answers, else podman. Podman gets, unless
#    CONTAINERS_CONF is set already, a containers.conf with what a host like the CI machine
#    needs: runtime runc (crun 1.8 refuses a hybrid cgroup layout), cgroupfs, events in a file,
#    nofile/nproc ulimits.
# 2. Base: PYTHON_IMAGE when set; else python:3.11-slim when it can be pulled; else, with
#    podman, a Debian bookworm base made here with mmdebstrap (python3, python3-venv,
#    python3-pip, ca-certificates; /usr/local/bin/python -> python3), tagged BASE_TAG and passed
#    as --build-arg PYTHON_IMAGE=.
# 3. pip: the host's own pip settings (`pip config list`: index, extra indexes, find-links,
#    trusted hosts, CA bundle, constraints) go in as the build args pip reads (PIP_*). Podman
#    bind-mounts the local paths they name, read-only, into the RUN steps (`podman build -v`);
#    docker cannot, so local paths are left out there. TORCH_CPU_INDEX is passed empty when a
#    find-links folder has torch+cpu already (set it to choose).
# 4. Run: the documented run line (`docker run --rm --shm-size 1g -p 8000:8000 steerserve:cpu`),
#    published on 127.0.0.1:PORT only, under compose's memory limit (MEMORY_LIMIT). It waits for
#    /ready, sends README.md's Japanese quick-start chat completion and its A/B request
#    (/v1/chat/completions/ab, steered arm applied), checks that the server does not run as root,
#    samples the container's memory, and stops it.
# 5. Prints build time, image size and layers, time to ready, peak memory and the replies; the
#    same in OUT/summary.txt, with the build log, the container log and the raw replies.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
IMAGE="${IMAGE:-steerserve:cpu}"
PORT="${PORT:-18000}"
OUT="${OUT:-${ROOT}/.work/image-check}"
BASE_TAG="${BASE_TAG:-localhost/steerserve-base:bookworm}"
UPSTREAM_BASE="docker.io/library/python:3.11-slim"
READY_TIMEOUT="${READY_TIMEOUT:-1200}"
SHM_SIZE="1g"             # the documented run line's --shm-size
# compose's CPU limit (deploy/compose.yaml): 10g where the server computes in bfloat16, the 14g
# compose asks for where the CPU has no native bfloat16 and it computes in float32 (with 10g the
# worker was OOM-killed loading the weights on an AVX2-only host).
if grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo 2>/dev/null; then
  MEMORY_LIMIT="${MEMORY_LIMIT:-10g}"
else
  MEMORY_LIMIT="${MEMORY_LIMIT:-14g}"
fi
MODEL_NAME="qwen2.5-coder-1.5b-instruct"
NAME="steerserve-image-check-$$"
mkdir -p "${OUT}"
SUMMARY="${OUT}/summary.txt"
: >"${SUMMARY}"

say() { printf '%s\n' "$*" | tee -a "${SUMMARY}"; }
die() {
  printf 'build-image: FAILED: %s\n' "$*" | tee -a "${SUMMARY}" >&2
  exit 1
}
need() { command -v "$1" >/dev/null 2>&1 || die "$1 not found${2:+ ($2)}"; }

# --- 1. engine ---------------------------------------------------------------------------------

pick_engine() {
  if [[ -n "${ENGINE:-}" ]]; then
    need "${ENGINE}"
  elif command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
    ENGINE=docker
  elif command -v podman >/dev/null 2>&1; then
    ENGINE=podman
  else
    die "no container engine: neither a docker daemon nor podman (apt-get install podman runc)"
  fi
  if [[ "${ENGINE}" == podman && -z "${CONTAINERS_CONF:-}" ]]; then
    local runtime=""
    if command -v runc >/dev/null 2>&1; then
      runtime='runtime = "runc"'
    fi
    CONTAINERS_CONF="${OUT}/containers.conf"
    cat >"${CONTAINERS_CONF}" <<EOF
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[engine]
${runtime}
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
    export CONTAINERS_CONF
  fi
  say "engine: ${ENGINE} ($("${ENGINE}" --version 2>/dev/null | head -n1))${CONTAINERS_CONF:+, CONTAINERS_CONF=${CONTAINERS_CONF}}"
}

# --- 2. base image -----------------------------------------------------------------------------

image_present() { "${ENGINE}" image inspect "$1" >/dev/null 2>&1; }

make_local_base() {
  [[ "${ENGINE}" == podman ]] || die "cannot pull ${UPSTREAM_BASE}; pass PYTHON_IMAGE=<a Python 3.11 Debian image>"
  need mmdebstrap "apt-get install mmdebstrap"
  local tar="${OUT}/base.tar" t0=${SECONDS}
  say "base: ${UPSTREAM_BASE} cannot be pulled; making ${BASE_TAG} with mmdebstrap"
  # The hook runs in mmdebstrap's shell, with the new root as $1.
  # shellcheck disable=SC2016
  mmdebstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    --customize-hook='mkdir -p "$1/usr/local/bin" && ln -sf /usr/bin/python3 "$1/usr/local/bin/python"' \
    bookworm "${tar}" \
    "deb http://deb.debian.org/debian bookworm main" \
    "deb http://deb.debian.org/debian bookworm-updates main" \
    "deb http://deb.debian.org/debian-security bookworm-security main" \
    >"${OUT}/base.log" 2>&1 || die "mmdebstrap failed: ${OUT}/base.log"
  "${ENGINE}" import --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' "${tar}" "${BASE_TAG}" \
    >>"${OUT}/base.log" 2>&1 || die "${ENGINE} import failed: ${OUT}/base.log"
  rm -f "${tar}"
  say "base: made in $((SECONDS - t0)) s"
}

pick_base() {
  if [[ -n "${PYTHON_IMAGE:-}" ]]; then
    BASE="${PYTHON_IMAGE}"
  elif image_present "${UPSTREAM_BASE}" \
    || timeout 180 "${ENGINE}" pull "${UPSTREAM_BASE}" >"${OUT}/pull.log" 2>&1; then
    BASE="${UPSTREAM_BASE}"
  else
    if ! image_present "${BASE_TAG}"; then
      make_local_base
    fi
    BASE="${BASE_TAG}"
  fi
  say "base: ${BASE}"
}

# --- 3. pip settings ---------------------------------------------------------------------------

# The host's effective pip settings as NAME=value lines for the keys the Dockerfile declares;
# later scopes win as in pip (global files, then [install], then PIP_* variables).
host_pip_settings() {
  command -v python3 >/dev/null 2>&1 || return 0
  python3 -m pip config list 2>/dev/null | python3 -c '
import re, sys
keys = ("index-url", "extra-index-url", "find-links", "trusted-host", "cert", "constraint")
lines = sys.stdin.read().splitlines()
got = {}
for scope in ("global", "install", ":env:"):
    for line in lines:
        m = re.fullmatch(r"(.+?)\.([a-z-]+)=(.*)", line)
        if m and m.group(1) == scope and m.group(2) in keys:
            got[m.group(2)] = m.group(3).strip("\x27\"")
for k, v in got.items():
    print("PIP_" + k.upper().replace("-", "_") + "=" + " ".join(v.split()))
' || true
}

BUILD_ARGS=()
MOUNTS=()
add_mount() {
  local p="$1"
  [[ -e "${p}" ]] || return 0
  local m
  for m in "${MOUNTS[@]+"${MOUNTS[@]}"}"; do
    [[ "${m}" == "${p}:${p}:ro" ]] && return 0
  done
  MOUNTS+=("${p}:${p}:ro")
}

pip_build_args() {
  local line name value kept tok path have_torch=""
  local -a toks
  while IFS= read -r line; do
    [[ -n "${line}" ]] || continue
    name="${line%%=*}"
    value="${line#*=}"
    kept=()
    read -r -a toks <<<"${value}"
    for tok in "${toks[@]+"${toks[@]}"}"; do
      path=""
      case "${tok}" in
        file://*) path="${tok#file://}" ;;
        /*) path="${tok}" ;;
      esac
      if [[ -n "${path}" ]]; then
        if [[ "${ENGINE}" != podman ]]; then
          say "pip: ${name}: ${tok} is a local path; docker build cannot mount it, left out"
          continue
        fi
        if [[ "${name}" == PIP_*INDEX_URL ]]; then
          add_mount "$(dirname "${path%/}")"  # an index's pages link to ../../files
        else
          add_mount "${path}"
        fi
        if [[ "${name}" == PIP_FIND_LINKS ]] && compgen -G "${path}/torch-*+cpu-*.whl" >/dev/null; then
          have_torch=1
        fi
      fi
      kept+=("${tok}")
    done
    if ((${#kept[@]})); then
      BUILD_ARGS+=(--build-arg "${name}=${kept[*]}")
      say "pip: ${name}=${kept[*]}"
    fi
  done < <(host_pip_settings)
  if [[ -n "${TORCH_CPU_INDEX+set}" ]]; then
    BUILD_ARGS+=(--build-arg "TORCH_CPU_INDEX=${TORCH_CPU_INDEX}")
  elif [[ -n "${have_torch}" ]]; then
    BUILD_ARGS+=(--build-arg "TORCH_CPU_INDEX=")
    say "pip: torch+cpu is in find-links: TORCH_CPU_INDEX="
  fi
}

# --- build -------------------------------------------------------------------------------------

build() {
  pick_base
  pip_build_args
  local -a cmd=("${ENGINE}" build -f deploy/Dockerfile.cpu -t "${IMAGE}"
    --build-arg "PYTHON_IMAGE=${BASE}" "${BUILD_ARGS[@]}")
  local m
  for m in "${MOUNTS[@]+"${MOUNTS[@]}"}"; do
    cmd+=(-v "${m}")
  done
  cmd+=(.)
  say "build: ${cmd[*]}"
  say "build: log in ${OUT}/build.log (tail -f it to follow; ~15-25 min on 2 cores)"
  if [[ -n "${PLAN_ONLY:-}" ]]; then
    say "run: ${ENGINE} run -d --name ${NAME} --shm-size ${SHM_SIZE} --memory ${MEMORY_LIMIT} -p 127.0.0.1:${PORT}:8000 ${IMAGE}"
    exit 0
  fi
  local t0=${SECONDS}
  (cd "${ROOT}" && "${cmd[@]}") >"${OUT}/build.log" 2>&1 \
    || { tail -n 40 "${OUT}/build.log" >&2; die "build failed: ${OUT}/build.log"; }
  BUILD_TIME="$((SECONDS - t0)) s"
  grep -E '^bake: |^prune: ' "${OUT}/build.log" | tee -a "${SUMMARY}" || true
}

# --- 4. run and check --------------------------------------------------------------------------

cleanup() {
  if "${ENGINE}" container inspect "${NAME}" >/dev/null 2>&1; then
    "${ENGINE}" logs "${NAME}" >"${OUT}/container.log" 2>&1 || true
    "${ENGINE}" rm -f "${NAME}" >/dev/null 2>&1 || true
  fi
}

# kB summed over the container's processes: VmRSS now, VmHWM (each process's own peak).
proc_mem() {
  "${ENGINE}" exec "${NAME}" sh -c 'cat /proc/[0-9]*/status 2>/dev/null' 2>/dev/null \
    | awk -v key="$1:" '$1 == key { s += $2 } END { print s + 0 }'
}

cgroup_peak() {
  "${ENGINE}" exec "${NAME}" sh -c 'cat /sys/fs/cgroup/memory.peak 2>/dev/null \
    || cat /sys/fs/cgroup/memory/memory.max_usage_in_bytes 2>/dev/null' 2>/dev/null || true
}

PEAK_KB=0
sample_mem() {
  local kb
  kb="$(proc_mem VmRSS || echo 0)"
  if ((kb > PEAK_KB)); then
    PEAK_KB=${kb}
  fi
}

post() {  # post PATH BODY OUTFILE -> HTTP status
  curl -sS -m 600 -o "$3" -w '%{http_code}' -H 'content-type: application/json' \
    --data-binary "$2" "http://127.0.0.1:${PORT}$1"
}

check_run() {
  need curl
  need python3
  trap cleanup EXIT
  local -a run=("${ENGINE}" run -d --name "${NAME}" --shm-size "${SHM_SIZE}"
    --memory "${MEMORY_LIMIT}" -p "127.0.0.1:${PORT}:8000" "${IMAGE}")
  say "run: ${run[*]}"
  local t0=${SECONDS}
  "${run[@]}" >/dev/null || die "${ENGINE} run failed"
  until curl -fsS -m 5 -o /dev/null "http://127.0.0.1:${PORT}/ready" 2>/dev/null; do
    if [[ "$("${ENGINE}" container inspect -f '{{.State.Running}}' "${NAME}" 2>/dev/null)" != true ]]; then
      "${ENGINE}" logs "${NAME}" 2>&1 | tail -n 40 >&2
      die "the container exited before /ready (log: ${OUT}/container.log)"
    fi
    ((SECONDS - t0 < READY_TIMEOUT)) || die "not ready after ${READY_TIMEOUT} s"
    sample_mem
    sleep 3
  done
  READY_SECONDS=$((SECONDS - t0))
  sample_mem

  local chat ab code
  chat='{"model": "'"${MODEL_NAME}"'", "max_tokens": 32, "temperature": 0,
    "messages": [{"role": "user", "content": "フランスの首都はどこですか？"}]}'
  ab='{"model": "'"${MODEL_NAME}"'", "max_tokens": 32, "temperature": 0,
    "messages": [{"role": "user", "content": "「百年の孤独」を書いたのは誰ですか？"}]}'
  code="$(post /v1/chat/completions "${chat}" "${OUT}/chat.json")" || true
  [[ "${code}" == 200 ]] || die "chat completion: HTTP ${code}: $(head -c 400 "${OUT}/chat.json")"
  sample_mem
  code="$(post /v1/chat/completions/ab "${ab}" "${OUT}/ab.json")" || true
  [[ "${code}" == 200 ]] || die "A/B request: HTTP ${code}: $(head -c 400 "${OUT}/ab.json")"
  sample_mem

  REPLIES="$(python3 - "${OUT}/chat.json" "${OUT}/ab.json" <<'EOF'
import json
import sys

chat = json.load(open(sys.argv[1]))
ab = json.load(open(sys.argv[2]))
text = chat["choices"][0]["message"]["content"]
print(f"chat: {text!r} (steering applied: {chat['steering']['applied']})")
un = ab["unsteered"]["choices"][0]["message"]["content"]
st = ab["steered"]["choices"][0]["message"]["content"]
applied = ab["steered"]["steering"]["applied"]
arts = [f"{i.get('artifact')}/{i.get('version')}:{i.get('name')}"
        for i in ab["steered"]["steering"].get("interventions", [])]
print(f"ab unsteered: {un!r}")
print(f"ab steered: {st!r} (applied: {applied}, {', '.join(arts)}; identical: {ab['identical']})")
problems = []
if "パリ" not in text:
    problems.append("the quick-start reply does not name パリ (README.md documents it)")
if not un or not st:
    problems.append("an A/B arm answered nothing")
if applied is not True or not arts:
    problems.append("the A/B request's steered arm applied no vectors")
for p in problems:
    print(f"PROBLEM: {p}")
sys.exit(1 if problems else 0)
EOF
)" || { say "${REPLIES}"; die "the replies are not what README.md documents"; }

  # Every process of the container (the server, vLLM's engine and worker), by its real uid.
  SERVER_UID="$("${ENGINE}" exec "${NAME}" sh -c 'cat /proc/[0-9]*/status 2>/dev/null' \
    | awk '$1 == "Uid:" { print $2 }' | sort -u | tr '\n' ' ' || true)"
  [[ -n "${SERVER_UID}" && " ${SERVER_UID}" != *" 0 "* ]] \
    || die "a process of the container runs as root (uids: ${SERVER_UID:-none read})"
  HWM_KB="$(proc_mem VmHWM || echo 0)"
  CGROUP_PEAK="$(cgroup_peak)"

  "${ENGINE}" stop -t 60 "${NAME}" >/dev/null || die "${ENGINE} stop failed"
  STOP_CODE="$("${ENGINE}" container inspect -f '{{.State.ExitCode}}' "${NAME}" 2>/dev/null || echo '?')"
}

# --- main --------------------------------------------------------------------------------------

main() {
  pick_engine
  case "${1:-}" in
    base) pick_base; return 0 ;;
    plan) PLAN_ONLY=1 build ;;
    "") ;;
    *) die "unknown command ${1} (base, plan, or none)" ;;
  esac
  BUILD_TIME="skipped (SKIP_BUILD)"
  if [[ -z "${SKIP_BUILD:-}" ]]; then
    build
  fi
  image_present "${IMAGE}" || die "no image ${IMAGE}"
  local size
  size="$("${ENGINE}" image inspect -f '{{.Size}}' "${IMAGE}")"
  "${ENGINE}" history --format '{{.Size}}\t{{.CreatedBy}}' "${IMAGE}" 2>/dev/null \
    | cut -c1-150 >"${OUT}/layers.txt" || true
  check_run
  say ""
  say "=== ${IMAGE} (${ENGINE}) ==="
  say "build time:      ${BUILD_TIME}"
  say "image size:      $(awk -v b="${size}" 'BEGIN { printf "%.2f GB (%d bytes)", b / 1e9, b }')"
  say "layers (size, instruction):"
  sed 's/^/  /' "${OUT}/layers.txt" | tee -a "${SUMMARY}"
  say "time to ready:   ${READY_SECONDS} s (run line: --shm-size ${SHM_SIZE}, --memory ${MEMORY_LIMIT})"
  say "memory:          peak summed RSS $(awk -v k="${PEAK_KB}" 'BEGIN { printf "%.2f GB", k * 1024 / 1e9 }') (sampled every 3 s);" \
    "summed per-process peaks (VmHWM) $(awk -v k="${HWM_KB}" 'BEGIN { printf "%.2f GB", k * 1024 / 1e9 }');" \
    "cgroup peak ${CGROUP_PEAK:-n/a} bytes"
  say "process uids:    ${SERVER_UID}"
  say "stop exit code:  ${STOP_CODE}"
  say "${REPLIES}"
  say "OK (logs and replies: ${OUT})"
}

main "$@"
