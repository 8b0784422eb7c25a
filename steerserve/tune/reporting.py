"""The one report writer of the research commands: ``<stem>.json``, ``<stem>.md`` and figures."""

from __future__ import annotations

import json
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
