"""Fixtures of the server tests that need no engine."""

from __future__ import annotations

import pytest

from steerserve.server.generate.policy import LanguageDetector


@pytest.fixture(scope="session")
def detector() -> LanguageDetector:
    """The language detector, its models loaded once (~2 s)."""
    d = LanguageDetector()
    d.warm()
    return d
