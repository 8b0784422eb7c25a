"""The evaluation report on hand-made results: schema, acceptance, files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from steerserve.research import evaluate as ev
from steerserve.research.arms import UNSTEERED
from steerserve.research.scoring import score_all


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
        UNSTEERED: score_all(rec, [" Paris", " Rome", " Paris", " Roma", "ローマ"]),
        "both": score_all(rec, [" Paris", " Rome", " París", " Roma", "パリ"]),
        "random": score_all(rec, [" Paris", " Rome", " Paris", " Rome", "ローマ"]),
    }
    rep = ev.build_report(rec, res, {"model": "m"})
    base = rep["arms"][UNSTEERED]
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
