"""The statistics on hand-made cases: Wilson and paired bootstrap intervals."""

from __future__ import annotations

import pytest

from steerserve.tune import scoring as ev


def test_wilson() -> None:
    lo, hi = ev.wilson(50, 100)
    assert lo == pytest.approx(0.4038, abs=1e-3) and hi == pytest.approx(0.5962, abs=1e-3)
    lo, hi = ev.wilson(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-3)
    assert ev.wilson(10, 10)[1] == 1.0
    assert ev.wilson(0, 0) == (0.0, 1.0)


def test_paired_bootstrap_detects_a_real_difference() -> None:
    a = {"fr": [1.0] * 30 + [0.0] * 10, "de": [1.0] * 25 + [0.0] * 15}
    same = ev.paired_bootstrap(a, a)
    assert same["diff"] == 0 and same["ci95"] == [0.0, 0.0]
    b = {"fr": [0.0] * 10 + a["fr"][10:], "de": [0.0] * 10 + a["de"][10:]}
    d = ev.paired_bootstrap(a, b)
    assert d["diff"] == pytest.approx(0.25) and d["ci95"][0] > 0 and d["p_le_0"] == 0.0
    lo, hi = ev.bootstrap_mean(a)
    assert lo < (30 / 40 + 25 / 40) / 2 < hi
