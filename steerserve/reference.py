"""Moved to :mod:`steerserve.research.reference`; this name stays for the GPU check scripts in
``bench/`` until they import the new one."""

from steerserve.research.reference import greedy, phases, steering_hooks

__all__ = ["greedy", "phases", "steering_hooks"]
