"""The package's commands, one file each: ``steerserve tune`` and the ``steerserve lab`` steps;
each parses its options into its stage's config and calls that stage's ``run``.
"""

from __future__ import annotations

from collections.abc import Callable

from steerserve.tune.cli import analyze, calibrate, evaluate, extract, tune

#: (name, command) under ``steerserve lab``, in the order its help lists them.
LAB: tuple[tuple[str, Callable[..., None]], ...] = (
    ("extract", extract.extract),
    ("calibrate", calibrate.calibrate),
    ("eval", evaluate.eval_cmd),
    ("analyze", analyze.analyze),
)
#: ``steerserve tune``
TUNE: Callable[..., None] = tune.tune
