"""The research experiments, one module each, behind one small interface (``base.Experiment``:
options, plan, run, report) and found by name in ``registry.EXPERIMENTS``.

Adding an experiment: write ``experiments/<name>.py`` defining ``EXPERIMENT = Experiment(...)``
and add it to ``registry.EXPERIMENTS``; ``python -m steerserve.research.ceilings --experiments
<name>`` then runs it, keeps its pieces under ``<out>/partial/`` and writes its report section.
"""
