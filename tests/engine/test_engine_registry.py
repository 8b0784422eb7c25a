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


def test_a_verified_digest_is_not_hashed_again(monkeypatch) -> None:
    """Issue 19: an artifact's vectors are hashed once at server start (``load_artifact``
    verifies each sha256; the server passes that digest on): ``add`` with ``sha256`` does not
    hash, and the same data again under that digest is the no-op it was."""
    t = torch.ones(4)
    digest = R.tensor_sha256(t)
    hashed: list[int] = []
    real = R.tensor_sha256
    monkeypatch.setattr(R, "tensor_sha256", lambda t: hashed.append(1) or real(t))
    reg = R.VectorRegistry(4)
    rv = reg.add("v", t, "src", sha256=digest)
    assert rv.sha256 == digest and reg.add("v", t, sha256=digest) is rv and hashed == []
    reg.add("w", t)  # no digest given: hashed as before
    assert hashed == [1]
