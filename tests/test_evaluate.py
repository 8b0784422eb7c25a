"""Evaluation scoring on hand-made cases: normalisation, first line, english_rate, intervals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from steerserve import evaluate as ev


def test_normalise_and_match() -> None:
    assert ev.normalise("  París.") == "parís"
    assert ev.normalise("ＰＡＲＩＳ") == "paris"  # NFKC full-width
    assert ev.normalise("Buenos-Aires!") == "buenosaires"
    assert ev.matches("Paris, France", ["Paris"])
    assert not ev.matches("Pa", ["Paris"])  # a prefix of the answer is not the answer
    assert not ev.matches("", ["Paris"])
    assert not ev.matches("Paris", [""])  # an empty gold answer matches nothing
    assert ev.matches("東京です", ["東京"])


def test_first_line() -> None:
    assert ev.first_line(" Paris\nCountry: Spain. Capital: Madrid") == "Paris"
    assert ev.first_line("\nParis") == ""  # an empty first line is a wrong answer
    assert ev.first_line("パリ") == "パリ"


def test_score_english_rate() -> None:
    s = ev.score(" Paris\n", ["París"], ["Paris"])
    assert (s.correct, s.english, s.recall_any) == (False, True, True)
    s = ev.score(" París", ["París"], ["Paris"])
    assert (s.correct, s.english) == (True, False)  # correct never also counts as English
    s = ev.score(" Rome", ["París"], ["Paris"])
    assert (s.correct, s.english, s.recall_any) == (False, False, False)
    s = ev.score(" Madrid", ["Madrid"], ["Madrid"])  # same name in both: correct, not English
    assert (s.correct, s.english) == (True, False)


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


def _records() -> list[dict]:
    rec = [
        {"id": "1", "lang": "en", "prompt": "p", "answers": ["Paris"], "answers_en": ["Paris"]},
        {"id": "2", "lang": "en", "prompt": "p", "answers": ["Rome"], "answers_en": ["Rome"]},
        {"id": "3", "lang": "es", "prompt": "p", "answers": ["París"], "answers_en": ["Paris"]},
        {"id": "4", "lang": "es", "prompt": "p", "answers": ["Roma"], "answers_en": ["Rome"]},
        {"id": "5", "lang": "ja", "prompt": "p", "answers": ["パリ"], "answers_en": ["Paris"]},
    ]
    return rec


def test_report_schema_and_files(tmp_path: Path) -> None:
    rec = _records()
    res = {
        "baseline": ev.score_all(rec, [" Paris", " Rome", " Paris", " Roma", "ローマ"]),
        "both": ev.score_all(rec, [" Paris", " Rome", " París", " Roma", "パリ"]),
        "random": ev.score_all(rec, [" Paris", " Rome", " Paris", " Rome", "ローマ"]),
    }
    rep = ev.build_report(rec, res, {"model": "m"})
    base = rep["arms"]["baseline"]
    assert set(base["per_language"]["es"]) >= {"n", "accuracy", "ci95", "english_rate"}
    assert base["per_language"]["es"] | {"ci95": None} == {
        "n": 2, "accuracy": 0.5, "ci95": None, "english_rate": 0.5, "recall_any": 1.0,
    }  # fmt: skip
    assert base["non_english_mean"] == pytest.approx((0.5 + 0.0) / 2)
    assert rep["arms"]["both"]["non_english_mean"] == 1.0
    assert rep["arms"]["random"]["per_language"]["es"]["english_rate"] == 1.0
    assert rep["acceptance"]["lowest_language"] == "ja"
    assert rep["acceptance"]["english_within_1pt"] is True
    out = ev.write_report(rep, tmp_path / "r")
    assert json.loads((out / "report.json").read_text())["arms"]["both"]["non_english_mean"] == 1
    assert "| es | 2 |" in (out / "report.md").read_text()
    assert (out / "accuracy.png").stat().st_size > 1000


def test_read_dataset(tmp_path: Path) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"id": "a", "lang": "fr", "prompt": "x", "answers": ["y"]}) + "\n\n")
    assert ev.read_dataset(p)[0]["answers_en"] == []
    p.write_text(json.dumps({"id": "a", "lang": "fr", "prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match="missing"):
        ev.read_dataset(p)


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
