"""The A/B experiment: who is steered (``experiment``), where its records go (``store``), and
what they say (``analysis``: the report ``ab-report`` and the live page read, with the
always-valid statistics of ``stats``)."""
