"""Resumable pieces of a long research run: each piece kept on disk as it finishes.

Why: an experiment on a real model runs for an hour on a shared CPU; a killed run resumes after
its last finished piece, and ``seconds.json`` keeps what each piece cost so a resumed run still
reports the compute it took.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("steerserve.research.cache")


def slim(res: Sequence[Mapping]) -> list[dict]:
    """Per-item results with floats rounded to 4 places (what a kept piece holds)."""
    return [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in res]


def slim_steps(res: Sequence[Sequence[Mapping]]) -> list[list[dict]]:
    """:func:`slim` of every step's results (``Runner.run``'s ``[step][item]``)."""
    return [slim(r) for r in res]


def cached(path: Path | None, fn: Callable[[], Any]) -> Any:
    """``fn()``, stored as JSON at ``path`` and read back from there on a rerun: a killed run
    resumes after its last finished piece."""
    if path is not None and path.is_file():
        log.info("reusing %s", path)
        return json.loads(path.read_text())
    t0 = time.perf_counter()
    out = fn()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(out, ensure_ascii=False))
        tmp.replace(path)
        record_seconds(path, time.perf_counter() - t0)
    return out


def record_seconds(path: Path, seconds: float) -> None:
    """Keep how long the piece at ``path`` took in its folder's ``seconds.json``, so a
    resumed run still reports the compute it took."""
    f = path.parent / "seconds.json"
    d = json.loads(f.read_text()) if f.is_file() else {}
    d[path.name] = round(seconds, 1)
    f.write_text(json.dumps(d, indent=1, sort_keys=True) + "\n")


def spent(folder: Path) -> float:
    """Seconds the pieces kept under ``folder`` took when they were computed."""
    return sum(sum(json.loads(f.read_text()).values()) for f in folder.rglob("seconds.json"))


def cached_tensors(path: Path | None, fn: Callable[[], Any]) -> Any:
    """``fn()`` (tensors in plain containers) kept with ``torch.save`` (see :func:`cached`)."""
    if path is not None and path.is_file():
        log.info("reusing %s", path)
        return torch.load(path, weights_only=False)
    t0 = time.perf_counter()
    out = fn()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(out, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").replace(path)
        record_seconds(path, time.perf_counter() - t0)
    return out
