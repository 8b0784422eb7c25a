"""The one writer of what the commands leave: reports (``<stem>.json``, ``.md``, figures) and
the tune run's JSON files, atomic, so a stage reads what another wrote without importing it."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any


def pct(x: float | None) -> str:
    """A share as a percentage with one decimal; ``–`` when there is none."""
    return "–" if x is None else f"{100 * x:.1f}"


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend (no display, safe in any thread)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write(
    out_dir: str | Path,
    data: Mapping[str, Any],
    markdown: str,
    figures: Mapping[str, Callable[[Path], None]] | None = None,
    stem: str = "report",
    indent: int = 2,
) -> Path:
    """``data`` as ``<stem>.json``, ``markdown`` as ``<stem>.md``, and each figure drawn by
    ``figures[file name](path)`` into ``out_dir``; returns ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, indent=indent, ensure_ascii=False)
    (out / f"{stem}.json").write_text(text + "\n", encoding="utf-8")
    (out / f"{stem}.md").write_text(markdown, encoding="utf-8")
    for name, draw in (figures or {}).items():
        draw(out / name)
    return out


def write_json(path: Path, obj: Any) -> None:
    """``obj`` as JSON at ``path``, atomically (a temp file renamed over it)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())
