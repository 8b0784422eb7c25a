"""The research code: where steering vectors come from and what they do.

``facts/`` (the multilingual fact set) feeds ``extract`` (candidate vectors from a transformers
model), ``calibrate`` (the sweep through the vLLM engine that writes an artifact), ``evaluate``
(an artifact's arms, ``arms.py``, scored by ``scoring.py``) and ``analyze`` (logit lens and the
recall / conversion failure split; ``analyze_report``, ``analyze_plots``). ``reference`` is plain
transformers steering, the oracle the engine is tested against; ``hf`` holds the transformers
helpers they share and ``report`` the one report writer. Nothing here is imported by the server.
"""
