"""The evaluation report on hand-made results: schema, acceptance, files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from steerserve.tune import evaluate as ev
from steerserve.tune.arms import UNSTEERED
from steerserve.tune.scoring import score_all


def _records() -> list[dict]:
    rec = [
        {"id": "1", "lang": "en", "prompt": "p", "answers": ["Paris"], "answers_en": ["Paris"]},
        {"id": "2", "lang": "en", "prompt": "p", "answers": ["Rome"], "answers_en": ["Rome"]},
        {"id": "3", "lang": "es", "prompt": "p", "answers": ["Londres"], "answers_en": ["London"]},
        {"id": "4", "lang": "es", "prompt": "p", "answers": ["Roma"], "answers_en": ["Rome"]},
        {"id": "5", "lang": "ja", "prompt": "p", "answers": ["パリ"], "answers_en": ["Paris"]},
    ]
    return rec


def test_report_schema_and_files(tmp_path: Path) -> None:
    rec = _records()
    res = {
        UNSTEERED: score_all(rec, [" Paris", " Rome", " London", " Roma", "ローマ"]),
        "both": score_all(rec, [" Paris", " Rome", " Londres", " Roma", "パリ"]),
        "random": score_all(rec, [" Paris", " Rome", " London", " Rome", "ローマ"]),
    }
    rep = ev.build_report(rec, res, {"model": "m"})
    base = rep["arms"][UNSTEERED]
    assert set(base["per_language"]["es"]) >= {"n", "accuracy", "ci95", "english_rate"}
    assert base["per_language"]["es"] | {"ci95": None} == {
        "n": 2, "accuracy": 0.5, "ci95": None, "english_rate": 0.5, "recall_any": 1.0,
        "chinese_rate": 0.0,
    }  # fmt: skip
    assert rep["scoring"]["form"] == "completion" and "starts with" in rep["scoring"]["correct"]
    assert base["non_english_mean"] == pytest.approx((0.5 + 0.0) / 2)
    assert rep["arms"]["both"]["non_english_mean"] == 1.0
    assert rep["arms"]["random"]["per_language"]["es"]["english_rate"] == 1.0
    assert rep["acceptance"]["lowest_language"] == "ja"
    assert rep["acceptance"]["english_within_1pt"] is True
    out = ev.write_report(rep, tmp_path / "r")
    assert json.loads((out / "report.json").read_text())["arms"]["both"]["non_english_mean"] == 1
    md = (out / "report.md").read_text()
    assert any(line.startswith("| es |") and "(n=2)" in line for line in md.splitlines())
    assert (out / "accuracy.png").stat().st_size > 1000


def _chat(i: str, lang: str, answers: list[str], en: list[str], zh: list[str]) -> dict:
    q = [{"role": "system", "content": "name only"}, {"role": "user", "content": "capital?"}]
    return {"id": i, "lang": lang, "messages": q, "answers": answers, "answers_en": en,
            "answers_zh": zh}  # fmt: skip


def test_chat_report_rates_and_rule(tmp_path: Path) -> None:
    """Chat records: containment in the first line, English and Chinese reply shares per
    language, the rule named in the report."""
    rec = [
        _chat("1", "ja", ["パリ"], ["Paris"], ["巴黎"]),
        _chat("2", "ja", ["ローマ"], ["Rome"], ["罗马"]),
        _chat("3", "ja", ["ベルリン"], ["Berlin"], ["柏林"]),
        _chat("4", "ja", ["リマ"], ["Lima"], ["利马"]),
        _chat("5", "ko", ["파리"], ["Paris"], ["巴黎"]),
        _chat("6", "zh", ["巴黎"], ["Paris"], ["巴黎"]),
        _chat("7", "en", ["Paris"], ["Paris"], ["巴黎"]),
    ]
    texts = [
        "フランスの首都はパリです。",  # correct: the answer occurs in the reply
        "罗马",  # Chinese answer
        "Berlin",  # English
        "マドリード\nリマ",  # wrong: only the first line counts
        "北京",  # Chinese script, not the answer: still a Chinese reply
        "巴黎",
        "The capital of France is Paris.",
    ]
    res = {UNSTEERED: score_all(rec, texts)}
    rep = ev.build_report(rec, res, {"model": "m"})
    per = rep["arms"][UNSTEERED]["per_language"]
    assert per["ja"]["accuracy"] == 0.25 and per["ja"]["n"] == 4
    assert per["ja"]["english_rate"] == 0.25 and per["ja"]["chinese_rate"] == 0.25
    assert per["ko"]["chinese_rate"] == 1.0 and per["zh"]["chinese_rate"] == 0.0
    assert per["zh"]["accuracy"] == per["en"]["accuracy"] == 1.0
    assert rep["arms"][UNSTEERED]["non_english_mean"] == (0.25 + 0 + 1) / 3
    assert rep["scoring"]["form"] == "chat" and "contains" in rep["scoring"]["correct"]
    md = ev.report_markdown(rep)
    assert "contains a folded accepted answer" in md
    assert "## Answered in Chinese instead of the query language" in md
