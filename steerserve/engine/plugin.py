"""vLLM general-plugin entry point (``vllm.general_plugins``: ``steerserve``).

Runs in every vLLM process (front end, engine core, workers); cheap, idempotent, no device work:
it only registers the ``Steered<Arch>`` classes by import path, so nothing heavy loads until a
steered model is built.
"""

from __future__ import annotations

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from vllm import ModelRegistry

    from steerserve.engine.archs import SUPPORTED, steered_name

    for arch in SUPPORTED:
        name = steered_name(arch)
        ModelRegistry.register_model(name, f"steerserve.engine.archs:{name}")
    _registered = True
