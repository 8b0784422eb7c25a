"""Making steering vectors: ``steerserve tune`` and the ``lab`` steps it chains.

``facts/`` feeds ``extract`` (candidates from transformers), ``calibrate`` (the sweep that writes
an artifact), ``evaluate`` (its arms through vLLM) and ``analyze`` (the diagnosis); ``pipeline``
runs them as one resumable ``tune`` (``stages``, ``gate``, ``testing``, ``summary``), ``cli/``
holds the commands. ``reference`` is the oracle the engine is tested against. The server imports
nothing from here.
"""
