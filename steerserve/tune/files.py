"""The tune run's JSON files, written atomically: one home for the stages, the test and the
report (each reads what another wrote; none imports another for it)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json(path: Path, obj: Any) -> None:
    """``obj`` as JSON at ``path``, atomically (a temp file renamed over it)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())
