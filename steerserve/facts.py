"""Moved to :mod:`steerserve.research.facts`; this name stays (the very same module) for callers
outside the research package until they import the new one."""

import sys

from steerserve.research import facts

sys.modules[__name__] = facts
