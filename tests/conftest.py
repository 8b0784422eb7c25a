"""Shared fixtures: tiny random models built offline, once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# One process per engine: fast start, workers reachable. Tests that need vLLM's default
# multi-process mode set it to "1" around their engine.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from steerserve.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: build_tiny_model(root / arch, arch) for arch in ("llama", "gemma3")}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def tiny_gemma(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["gemma3"]
