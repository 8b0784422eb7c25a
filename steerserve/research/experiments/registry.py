"""Every experiment by name: ``--experiments`` and the report look them up here.

Adding one: a module in ``experiments/`` defining ``EXPERIMENT``, and one line below.
"""

from __future__ import annotations

from steerserve.research.experiments import funcvec, headroom, oracle, taskvec, translation
from steerserve.research.experiments.base import Experiment

EXPERIMENTS: dict[str, Experiment] = {
    e.name: e
    for e in (
        headroom.EXPERIMENT,
        oracle.EXPERIMENT,
        taskvec.EXPERIMENT,
        translation.EXPERIMENT,
        funcvec.EXPERIMENT,
    )
}


def register(experiment: Experiment) -> Experiment:
    """Add ``experiment`` (a notebook's or a test's own) under its name; returns it."""
    EXPERIMENTS[experiment.name] = experiment
    return experiment
