"""Running a bench script's ``--dry-run`` on the tiny model, as the bench tests do."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def dry_run(script: str, model: Path, out: Path, *extra: str) -> dict:
    """``bench/<script> --dry-run`` on ``model`` in float32: the JSON it wrote (exit 0 asserted)."""
    cmd = [sys.executable, str(ROOT / "bench" / script), "--dry-run", "--model", str(model)]
    cmd += ["--dtype", "float32", "--out", str(out), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())
