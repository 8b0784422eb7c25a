"""vLLM general-plugin entry point (``vllm.general_plugins``: ``steerserve``).

Runs in every vLLM process (front end, engine core, workers); cheap, idempotent, no device work:
it registers the ``Steered<Arch>`` classes by import path, so nothing heavy loads until a
steered model is built, installs the prefix-cache seam (``prefix.py``), which the scheduler
(in the engine core) uses, and the lifeline (``lifeline.py``): EngineCore and its worker stop
when their parent dies, however it died.
"""

from __future__ import annotations

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from vllm import ModelRegistry

    from steerserve.engine import lifeline, prefix
    from steerserve.engine.archs import SUPPORTED, steered_name

    for arch in SUPPORTED:
        name = steered_name(arch)
        ModelRegistry.register_model(name, f"steerserve.engine.archs:{name}")
    prefix.install()
    lifeline.install()
    _registered = True
