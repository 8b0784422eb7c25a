"""The interface every experiment implements, and the context it is run in.

Why a small interface: the runner, the cache and the report are shared; an experiment only says
which items it runs on (``plan``), what it computes (``run``) and how its result reads
(``report``), so a new one is one file and cannot reach into another's privates.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from steerserve.research.facts import Fact, eval_records
from steerserve.research.runner import Runner


def split_part(s: str) -> tuple[int, int]:
    """``"k/n"`` -> ``(k, n)``: every n-th fact of each relation from the k-th."""
    k, n = s.split("/")
    return int(k), int(n)


def ci(d: Mapping[str, Any], scale: float = 100.0, fmt: str = "{:+.1f}") -> str:
    """A paired difference with its 95 % interval: ``+1.2 [-0.4, +2.8]``."""
    lo, hi = d["ci95"]
    return f"{fmt.format(scale * d['diff'])} [{fmt.format(scale * lo)}, {fmt.format(scale * hi)}]"


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",")]


def floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",")]


@dataclass(frozen=True)
class Context:
    """What every experiment of one run shares: the model's runner, the facts of the split,
    the parsed options, the prompt form, the query languages and the report folder."""

    runner: Runner
    facts: Mapping[str, Fact]
    args: argparse.Namespace
    form: str
    langs: list[str] | None  # English included; None: every language
    out: Path

    def records(self, part: tuple[int, int], limit_per_lang: int | None = None) -> list[dict]:
        """The evaluation records of the run's split, languages and form, one part of them."""
        return eval_records(
            self.args.split,
            langs=self.langs,
            part=part,
            limit_per_lang=limit_per_lang,
            form=self.form,
        )

    def describe(self, part: tuple[int, int]) -> str:
        """How a part of the split reads in a report's setup line."""
        return f"every {part[1]}-th fact of each relation from the {part[0]}-th, {self.args.split} split"

    def partial(self, key: str) -> Path:
        """Where the pieces of the experiment run under ``key`` are kept (resumable)."""
        return self.out / "partial" / key


@dataclass(frozen=True)
class Plan:
    """One run of an experiment: its name in the report (``oracle@0of4``), its setup sentence
    and the inputs ``run`` takes (items, options)."""

    key: str
    setup: str
    inputs: dict[str, Any] = field(default_factory=dict)


def _no_figures(exp: Mapping[str, Any]) -> dict[str, Callable[[Path], None]]:  # noqa: ARG001
    return {}


@dataclass(frozen=True)
class Experiment:
    """An experiment: ``plan`` picks its items from the context, ``run`` computes its result
    (a JSON-able dict), ``report`` renders that result as markdown lines under ``title``;
    ``options`` add its flags (one shared by several experiments is added once); ``figures``
    names the PNGs it draws (suffix of the file name after the run's key -> writer)."""

    name: str
    title: str
    plan: Callable[[Context], Plan]
    run: Callable[[Context, Plan], dict[str, Any]]
    report: Callable[[Mapping[str, Any]], list[str]]
    options: Sequence[Callable[[argparse.ArgumentParser], None]] = ()
    figures: Callable[[Mapping[str, Any]], dict[str, Callable[[Path], None]]] = _no_figures
