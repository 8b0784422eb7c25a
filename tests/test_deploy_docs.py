"""The documented ways to run the images carry what a real run needed (issue 31), so docs cannot
drift from it again. No build, no engine: the run lines are parsed out of the Dockerfiles' header
comments, deploy/README.md and README.md, and compose.yaml out of its YAML.

What a real run needed (deploy/build-image.sh, podman 4.3): vLLM's server and engine share a
160 MiB ring buffer in /dev/shm, and with Docker's default 64 MB the CPU server dies at start, so
every run line sets --shm-size and compose sets shm_size; the CPU server measured 8.3 GB peak RSS
while serving, so compose's limit must stay above that, with the number written beside it.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
BUILD_SCRIPT = DEPLOY / "build-image.sh"
# Files whose run lines users copy; each must have at least one.
RUN_DOCS = [
    DEPLOY / "Dockerfile.cpu",
    ROOT / "Dockerfile",
    DEPLOY / "README.md",
    ROOT / "README.md",
]
SERVICE = {"cpu": "steerserve-cpu", "gpu": "steerserve-gpu"}
VLLM_SHM_NEED = 160 << 20  # "160 MiB required" (vLLM's message)
MEASURED_PEAK = "8.3 GB"  # peak RSS of the CPU image serving the default model (issue 31)
MARGIN = 1.15  # the limit must exceed the measured peak by at least this factor


def size_bytes(value: Any) -> int:
    """Docker's sizes: a number of bytes, or a number with b/k/m/g (1024-based), 'gb' alike."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([bkmg]?)b?\s*", str(value).lower())
    assert m, f"not a size: {value!r}"
    return int(float(m.group(1)) * 1024 ** "bkmg".index(m.group(2) or "b"))


def run_lines(path: Path) -> list[list[str]]:
    """``docker run`` commands written as commands (code blocks, a Dockerfile's comment header):
    comment markers stripped, continuations joined; prose that quotes one is not a command."""
    out: list[list[str]] = []
    buf = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if path.name.startswith("Dockerfile"):
            if not line.startswith("#"):
                buf = ""
                continue
            line = line.lstrip("#").strip()
        if buf:
            line = buf + " " + line
            buf = ""
        if line.endswith("\\"):
            buf = line[:-1].strip()
            continue
        if line.startswith("docker run "):
            out.append(shlex.split(line.split(" #", 1)[0]))
    return out


def image_kind(cmd: list[str]) -> str:
    images = [t for t in cmd if t.startswith("steerserve:")]
    assert len(images) == 1, cmd
    return "cpu" if images[0] == "steerserve:cpu" else "gpu"


def flag(cmd: list[str], name: str) -> str | None:
    for i, t in enumerate(cmd):
        if t == name and i + 1 < len(cmd):
            return cmd[i + 1]
        if t.startswith(name + "="):
            return t.split("=", 1)[1]
    return None


def defaults(value: Any) -> Any:
    """Compose's interpolation with no variable set: ${V:-d} and ${V-d} give d, ${V} nothing."""
    if isinstance(value, dict):
        return {k: defaults(v) for k, v in value.items()}
    if isinstance(value, list):
        return [defaults(v) for v in value]
    if not isinstance(value, str):
        return value
    return re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*(?::?-([^}]*))?\}", lambda m: m.group(1) or "", value)


def compose() -> dict:
    return defaults(yaml.safe_load(COMPOSE.read_text()))


def script_default(name: str) -> str:
    """A variable's value or default in build-image.sh: NAME="v" or NAME="${NAME:-v}"."""
    m = re.search(rf'^{name}="(?:\$\{{{name}:-)?([^"}}]+)\}}?"', BUILD_SCRIPT.read_text(), re.M)
    assert m, f"build-image.sh sets no {name}"
    return m.group(1)


def test_every_documented_run_line_sets_shm_size() -> None:
    services = compose()["services"]
    seen = set()
    for path in RUN_DOCS:
        lines = run_lines(path)
        assert lines, f"{path.relative_to(ROOT)}: no `docker run` line found"
        for cmd in lines:
            kind = image_kind(cmd)
            seen.add(kind)
            shm = flag(cmd, "--shm-size")
            where = f"{path.relative_to(ROOT)}: {shlex.join(cmd)}"
            assert shm, f"{where}: no --shm-size (Docker's 64 MB /dev/shm kills the server)"
            assert size_bytes(shm) >= VLLM_SHM_NEED, where
            expected = services[SERVICE[kind]]["shm_size"]
            assert size_bytes(shm) == size_bytes(expected), f"{where}: compose says {expected}"
    assert seen == {"cpu", "gpu"}


def test_compose_cpu_service_has_shm_and_the_measured_memory_limit() -> None:
    cpu = compose()["services"]["steerserve-cpu"]
    assert size_bytes(cpu["shm_size"]) >= VLLM_SHM_NEED
    limit = size_bytes(cpu["deploy"]["resources"]["limits"]["memory"])
    peak = float(MEASURED_PEAK.split()[0]) * 1e9
    assert limit >= MARGIN * peak, f"compose's {limit / 1e9:.1f} GB is too close to {MEASURED_PEAK}"
    # The number the limit comes from is written beside it, and the docs give the same limit.
    text = COMPOSE.read_text()
    block = text[text.index("steerserve-cpu:") :]
    assert MEASURED_PEAK in block, f"compose.yaml: write the measured {MEASURED_PEAK} beside it"
    raw = yaml.safe_load(text)["services"]["steerserve-cpu"]["deploy"]["resources"]["limits"]
    default = re.search(r":-([^}]+)\}", str(raw["memory"]))
    shown = default.group(1) if default else str(raw["memory"])
    for doc in (DEPLOY / "README.md", ROOT / "README.md", DEPLOY / "Dockerfile.cpu"):
        body = doc.read_text()
        assert MEASURED_PEAK in body and shown in body, f"{doc.name}: {MEASURED_PEAK}, {shown}"


def test_gpu_service_has_shm() -> None:
    gpu = compose()["services"]["steerserve-gpu"]
    assert size_bytes(gpu["shm_size"]) >= VLLM_SHM_NEED


def test_build_script_runs_the_documented_line() -> None:
    """deploy/build-image.sh checks the image with the documented --shm-size and under compose's
    memory limit, and sends the README's own requests."""
    (cpu_line, *_) = [c for c in run_lines(DEPLOY / "README.md") if image_kind(c) == "cpu"]
    script = BUILD_SCRIPT.read_text()
    assert size_bytes(script_default("SHM_SIZE")) == size_bytes(flag(cpu_line, "--shm-size"))
    assert '--shm-size "${SHM_SIZE}"' in script and '--memory "${MEMORY_LIMIT}"' in script
    limits = compose()["services"]["steerserve-cpu"]["deploy"]["resources"]["limits"]
    # bfloat16 CPUs: compose's default; without native bfloat16: the float32 limit compose names
    bf16, fp32 = re.findall(r'^\s*MEMORY_LIMIT="\$\{MEMORY_LIMIT:-([^"}]+)\}"', script, re.M)
    assert size_bytes(bf16) == size_bytes(limits["memory"])
    assert f"STEERSERVE_CPU_MEMORY_LIMIT={fp32}" in COMPOSE.read_text()
    readme = (ROOT / "README.md").read_text()
    for text in ("フランスの首都はどこですか？", "「百年の孤独」を書いたのは誰ですか？"):
        assert text in script and text in readme, text
    from steerserve.models import DEFAULT_MODEL

    assert script_default("MODEL_NAME") == DEFAULT_MODEL
    assert f'"model": "{DEFAULT_MODEL}"' in readme


def test_docs_name_the_cpu_image_model() -> None:
    """The CPU image serves the default embedded model; its files say so and give no stale
    name or size (they once described Gemma 3 270M and "~3.5 GB in bfloat16")."""
    from steerserve.models import DEFAULT_MODEL

    for path in (DEPLOY / "Dockerfile.cpu", COMPOSE):
        text = path.read_text()
        assert DEFAULT_MODEL in text.lower(), path.name
        assert "gemma" not in text.lower(), f"{path.name} names Gemma"
        assert "3.5 GB" not in text, path.name
    row = next(
        line
        for line in (DEPLOY / "README.md").read_text().splitlines()
        if "(Dockerfile.cpu)" in line
    )
    assert DEFAULT_MODEL in row.lower() and "gemma" not in row.lower(), row


def docker_compose() -> list[str] | None:
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]) is None:
            continue
        p = subprocess.run([*cmd, "version"], capture_output=True, text=True, timeout=30)
        if p.returncode == 0:
            return cmd
    return None


def test_docker_compose_config_accepts_the_limits() -> None:
    """Where Compose itself is installed, its own reading of the file agrees."""
    cmd = docker_compose()
    if cmd is None:
        pytest.skip("no `docker compose` here; compose.yaml is checked against the vendored schema")
    p = subprocess.run(
        [*cmd, "-f", str(COMPOSE), "--profile", "cpu", "config", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stderr
    svc = json.loads(p.stdout)["services"]["steerserve-cpu"]
    assert size_bytes(svc["shm_size"]) == 1 << 30
    assert size_bytes(svc["deploy"]["resources"]["limits"]["memory"]) >= MARGIN * 7.8e9
