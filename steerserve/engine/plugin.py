"""vLLM general-plugin entry point (``vllm.general_plugins``: ``steerserve``)."""

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
