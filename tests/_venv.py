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
