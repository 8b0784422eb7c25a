"""Fixtures of the tune tests that drive the transformers runner on the tiny random Gemma 3."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from steerserve.tune.runner import Runner


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny matmuls on a shared CPU: a second thread only waits at barriers (10x slower).
    A module opts in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def runner(tiny_gemma: Path) -> Runner:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_gemma, dtype=torch.float32).eval()
    return Runner(model, AutoTokenizer.from_pretrained(tiny_gemma), batch_size=3)
