"""The arms of an artifact and the same-norm controls."""

from __future__ import annotations

import pytest

from steerserve.tune import arms as ev


def test_random_like_keeps_norm() -> None:
    import torch

    v = torch.randn(64) * 7
    r = ev.random_like(v, 3)
    assert float(r.norm()) == pytest.approx(float(v.norm()), rel=1e-5)
    assert abs(float(torch.nn.functional.cosine_similarity(r, v, dim=0))) < 0.5
    torch.testing.assert_close(r, ev.random_like(v, 3))


def test_random_controls_keep_the_norm() -> None:
    import torch

    v = torch.tensor([300.0, -2.0, 1.0, 0.5, -0.25] * 8)
    iso, signs = ev.random_like(v, 3), ev.random_signs_like(v, 3)
    assert iso.norm() == pytest.approx(v.norm()) and signs.norm() == pytest.approx(v.norm())
    assert torch.equal(signs.abs(), v.abs()), "per-dimension magnitudes kept"
    assert not torch.equal(signs, v) and not torch.equal(signs, -v), "signs actually drawn"
    assert torch.equal(signs, ev.random_signs_like(v, 3)), "seeded"
    assert iso.abs().max() < 0.9 * v.norm(), "the isotropic control spreads the norm"
