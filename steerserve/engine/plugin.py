"""vLLM general-plugin entry point (``vllm.general_plugins``: ``steerserve``).

Runs in every vLLM process (front end, engine core, workers) of every vLLM in the environment,
stock ``vllm serve`` included; cheap, idempotent, no device work. Everywhere it only registers
the ``Steered<Arch>`` classes by import path (inert: an engine selects them only through the
``hf_overrides`` steerserve passes). The seams that change vLLM's behaviour, the prefix-cache key
(``prefix.py``, used by the scheduler in the engine core) and the lifeline (``lifeline.py``:
EngineCore and its worker stop when their parent dies), are installed only in engines steerserve
starts: :func:`activate` marks the process (:data:`ENV`), and the processes vLLM starts from it
inherit the mark and install them when they load the plugin.
"""

from __future__ import annotations

import os

#: Set (to ``"1"``) in a process that builds a steerserve engine; its children inherit it.
ENV = "STEERSERVE_ENGINE"
#: xgrammar's compiler cache in a steerserve engine, in MB (vLLM's default 512 MB, which the
#: engine core never gives back), unless ``VLLM_XGRAMMAR_CACHE_MB`` is set already.
XGRAMMAR_CACHE_MB = 64

_registered = False
_active = False


def register() -> None:
    global _registered
    if not _registered:
        from vllm import ModelRegistry

        from steerserve.engine.archs import SUPPORTED, steered_name

        for arch in SUPPORTED:
            name = steered_name(arch)
            ModelRegistry.register_model(name, f"steerserve.engine.archs:{name}")
        _registered = True
    if os.environ.get(ENV) == "1":
        _install()


def activate() -> None:
    """Called before steerserve builds an engine: this process and every process it starts are
    steerserve's, with the seams installed and xgrammar's cache bounded (idempotent)."""
    os.environ[ENV] = "1"
    os.environ.setdefault("VLLM_XGRAMMAR_CACHE_MB", str(XGRAMMAR_CACHE_MB))
    register()


def _install() -> None:
    global _active
    if _active:
        return
    from steerserve.engine import degenerate, lifeline, prefix

    prefix.install()
    lifeline.install()
    degenerate.install()
    _active = True
