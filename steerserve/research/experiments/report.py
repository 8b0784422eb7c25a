"""The ceilings report: ``report.json`` (everything), ``summary.json`` (committable, no
per-item results) and ``report.md`` (commands first, then each experiment's section).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from steerserve.research.experiments.registry import EXPERIMENTS
from steerserve.research.reporting import write


def write_report(report: Mapping[str, Any], out: Path) -> None:
    """``report.json`` (everything) and ``report.md`` (commands first, then each experiment)."""
    lines = [f"# Ceilings: {report['model']}", "", "Commands (each experiment as run):", ""]
    for name, exp in report["experiments"].items():
        lines += [f"```bash\n# {name}\n{exp['command']}\n```"]
    figs = {}
    for name, exp in report["experiments"].items():
        base, _, at = name.partition("@")
        kind = EXPERIMENTS.get(base)  # an experiment no longer registered keeps its setup line
        title = (kind.title if kind else base) + (f" (part {at.replace('of', '/')})" if at else "")
        lines += ["", f"## {title}", "", exp.get("setup", ""), ""]
        lines += kind.report(exp) if kind else []
        for suffix, draw in (kind.figures(exp) if kind else {}).items():
            figs[f"{name.replace('@', '-')}{suffix}.png"] = draw
    write(out, report, "\n".join(lines) + "\n", figs, indent=1)
    (out / "summary.json").write_text(
        json.dumps(summary_only(report), indent=1, ensure_ascii=False) + "\n", encoding="utf-8"
    )


def summary_only(d: Any) -> Any:
    """``d`` without its per-item results (``items``, ``ids``): the small, committable part of
    a report (the per-item results stay in report.json and partial/)."""
    if isinstance(d, Mapping):
        return {k: summary_only(v) for k, v in d.items() if k not in ("items", "ids")}
    if isinstance(d, list):
        return [summary_only(v) for v in d]
    return d


def load_report(out: Path) -> dict[str, Any] | None:
    """The folder's report to merge into: ``report.json``, else the committed ``summary.json``
    (report.json holds per-item results and is not committed: a fresh checkout has only the
    summary, and starting empty would drop the experiments it records from report.md)."""
    for name in ("report.json", "summary.json"):
        if (out / name).is_file():
            return json.loads((out / name).read_text(encoding="utf-8"))
    return None
