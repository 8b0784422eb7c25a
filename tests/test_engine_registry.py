"""engine/registry.py: a vector checked aside is admitted without hashing it again."""

from __future__ import annotations

import pytest
import torch

from steerserve.engine import registry as R


def test_admit_takes_the_checked_vector_and_keeps_names_immutable(monkeypatch) -> None:
    aside = R.VectorRegistry(4).add("v", torch.ones(4), "src")
    hashed: list[int] = []
    real = R.tensor_sha256
    monkeypatch.setattr(R, "tensor_sha256", lambda t: hashed.append(1) or real(t))
    reg = R.VectorRegistry(4)
    assert reg.admit(aside) is aside and reg["v"].sha256 == aside.sha256
    assert reg.admit(aside) is aside and hashed == []  # the same data again: a no-op, no hash
    other = R.VectorRegistry(4).add("v", torch.zeros(4))
    with pytest.raises(ValueError, match="different data"):
        reg.admit(other)
    with pytest.raises(ValueError, match="hidden size"):
        R.VectorRegistry(8).admit(aside)
