"""`steerserve ab-report` on generated logs: a known difference lies inside its CI, small samples
call no winner."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from steerserve.server.ab.analysis import build_report, read_log, write_report


def _log(path: Path, n: int, p_steered: float, p_unsteered: float, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            arm = "steered" if i % 2 else "unsteered"
            lang = "ja" if i % 3 else "ko"
            rid = f"chatcmpl-{i}"
            f.write(
                json.dumps(
                    {
                        "type": "decision",
                        "id": rid,
                        "experiment": "e1",
                        "arm": arm,
                        "language": lang,
                        "latency_ms": 100 + i % 50,
                    }
                )
                + "\n"
            )
            p = p_steered if arm == "steered" else p_unsteered
            f.write(
                json.dumps({"type": "feedback", "id": rid, "score": float(rng.random() < p)}) + "\n"
            )
        f.write(json.dumps({"type": "decision", "id": "x", "experiment": None, "arm": None}) + "\n")
        f.write('{"type": "feedb')  # a torn last line


def test_known_difference_is_inside_the_ci_and_called(tmp_path: Path) -> None:
    path = tmp_path / "ab.jsonl"
    _log(path, 4000, 0.7, 0.5)
    rep = build_report(read_log(path))
    assert rep["not_enrolled"] == 1
    exp = rep["experiments"]["e1"]["overall"]
    lo, hi = exp["difference"]["ci"]
    assert lo < 0.2 < hi and lo > 0
    assert exp["verdict"].startswith("steered wins")
    assert exp["arms"]["steered"]["requests"] == 2000
    assert exp["arms"]["steered"]["latency_ms"]["p50"] is not None
    assert set(rep["experiments"]["e1"]["per_language"]) == {"ja", "ko"}
    md = write_report(rep, tmp_path / "out")
    assert "steered wins" in md.read_text()
    assert (tmp_path / "out" / "report.png").stat().st_size > 1000
    assert json.loads((tmp_path / "out" / "report.json").read_text())["requests"] == 4001


def test_small_or_equal_samples_call_no_winner(tmp_path: Path) -> None:
    path = tmp_path / "ab.jsonl"
    _log(path, 20, 0.9, 0.1)
    rep = build_report(read_log(path))
    assert rep["experiments"]["e1"]["overall"]["verdict"].startswith("too few scored replies")
    _log(path, 4000, 0.5, 0.5, seed=1)
    assert build_report(read_log(path))["experiments"]["e1"]["overall"]["verdict"].startswith(
        "no significant difference"
    )


def test_d7_corrupted_lines_are_skipped_counted_and_the_report_stays_json(tmp_path: Path) -> None:
    """Issue 21, defect 7: ``steerserve ab-report`` on a log with corrupted lines (language or
    experiment as a number or a list, a string latency, NaN, ``true`` and out-of-range scores,
    non-JSON) reports on the rest, says how many it skipped and exits 1; ``--out`` naming an
    existing file is refused as a usage error; report.json is valid JSON."""
    from typer.testing import CliRunner

    from steerserve.cli import app

    path = tmp_path / "ab.jsonl"
    _log(path, 200, 0.7, 0.5)
    good = path.read_text().rsplit("\n", 1)[0] + "\n"  # without the torn last line
    bad = [
        {"type": "decision", "id": "b1", "experiment": "e1", "arm": "steered", "language": 7},
        {"type": "decision", "id": "b2", "experiment": ["e1"], "arm": "steered"},
        {"type": "decision", "id": "b3", "experiment": "e1", "arm": "x", "language": ["ja"]},
        {"type": "decision", "id": "b4", "experiment": "e1", "arm": "steered", "latency_ms": "9"},
        {"type": "feedback", "id": "chatcmpl-1", "score": True},
        {"type": "feedback", "id": "chatcmpl-1", "score": -1e308},
        {"type": "feedback", "id": "chatcmpl-3", "score": "1"},
    ]
    lines = [json.dumps(x) for x in bad] + [
        '{"type": "feedback", "id": "chatcmpl-5", "score": NaN}'
    ]
    lines += ["not json", "[1, 2]"]
    path.write_text(good + "\n".join(lines) + "\n")
    runner = CliRunner()
    out = runner.invoke(app, ["ab-report", str(path), "--out", str(tmp_path / "r")])
    assert out.exit_code == 1, out.output
    assert out.exception is None or isinstance(out.exception, SystemExit), out.exception
    assert f"{len(lines)} unreadable line(s)" in out.output, out.output
    assert "nan" not in out.output.lower() and "inf" not in out.output.lower(), out.output
    rep = json.loads((tmp_path / "r" / "report.json").read_text(), parse_constant=_refuse)
    assert rep["skipped_lines"] == len(lines) and rep["requests"] == 201
    scores = rep["experiments"]["e1"]["overall"]["arms"]["steered"]["score"]
    assert scores["n"] == 100  # chatcmpl-1's scores of true and -1e308 were not taken
    (tmp_path / "file").write_text("")
    out = runner.invoke(app, ["ab-report", str(path), "--out", str(tmp_path / "file")])
    assert out.exit_code == 2 and "is not a folder" in out.output, out.output


def _refuse(name: str) -> None:
    raise AssertionError(f"{name} in report.json")


def test_every_ignored_line_is_counted_torn_lines_and_orphan_feedback_too(tmp_path: Path) -> None:
    """Issue 33: a torn last line and feedback for an answer with no decision line in the log
    (the line was lost) are counted and named, not dropped without a word; ``ab-report`` exits
    1 on them; the scores that do join are the ones reported."""
    from typer.testing import CliRunner

    from steerserve.cli import app

    path = tmp_path / "ab.jsonl"
    _log(path, 40, 0.7, 0.5)  # ends in a torn line
    with open(path, "a") as f:  # the torn line ended by the next one, as the server does
        f.write("\n" + json.dumps({"type": "feedback", "id": "chatcmpl-lost", "score": 1}))
        f.write("\n" + json.dumps({"type": "feedback", "id": "chatcmpl-lost", "score": -1}) + "\n")
    out = CliRunner().invoke(app, ["ab-report", str(path), "--out", str(tmp_path / "r")])
    assert out.exit_code == 1, out.output
    note = "3 line(s) of the log skipped: 1 unreadable line(s), 2 feedback line(s) for an answer"
    assert note in out.output, out.output
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    assert (rep["skipped_lines"], rep["unreadable_lines"], rep["orphan_feedback_lines"]) == (
        3,
        1,
        2,
    )
    assert rep["requests"] == 41
    arms = rep["experiments"]["e1"]["overall"]["arms"]
    assert arms["steered"]["score"]["n"] + arms["unsteered"]["score"]["n"] == 40


def test_ab_report_checks_the_sample_ratio_against_a_given_split(tmp_path: Path) -> None:
    """``ab-report --split``: the log does not record the split; given, the report compares it
    with what the log shows (here 20 and 20 requests: as 0.5 says, far from 0.8)."""
    from typer.testing import CliRunner

    from steerserve.cli import app

    path = tmp_path / "ab.jsonl"
    _log(path, 40, 0.7, 0.5)
    plain = CliRunner().invoke(app, ["ab-report", str(path)])
    assert "not checked" in plain.output, plain.output
    even = CliRunner().invoke(app, ["ab-report", str(path), "--split", "0.5"])
    assert "not checked" not in even.output and "MISMATCH" not in even.output, even.output
    skewed = CliRunner().invoke(app, ["ab-report", str(path), "--split", "0.8"])
    assert "SAMPLE RATIO MISMATCH" in skewed.output, skewed.output


def _line(rid: str, arm: str, lang: str, user: str, **kw: object) -> str:
    rec = {"type": "decision", "id": rid, "experiment": "e1", "arm": arm, "language": lang}
    return json.dumps(rec | {"subject_hash": user, **kw}) + "\n"


def _fb(rid: str, score: float) -> str:
    return json.dumps({"type": "feedback", "id": rid, "score": score}) + "\n"


def test_a_log_from_before_metrics_still_reports_and_says_what_is_missing(
    tmp_path: Path,
) -> None:
    """An old log (no reply languages, no ``applied``, no subject hashes): feedback and latency
    are reported as before, the language metrics are said to be missing (never 0), the unit is
    the request and each arm's applied status "unknown"."""
    path = tmp_path / "old.jsonl"
    _log(path, 400, 0.7, 0.5)
    rep = build_report(read_log(path))
    exp = rep["experiments"]["e1"]
    o = exp["overall"]
    assert exp["family"]["metrics"] == ["feedback", "latency_ms"]
    assert "language_match" not in o["metrics"] and exp["unit"].startswith("requests")
    assert o["applied"]["status"] == "unknown" and exp["not_applied"] == []
    assert o["metrics"]["feedback"]["status"] in ("called", "open")
    md = write_report(rep, tmp_path / "r").read_text()
    assert "| feedback | all |" in md and "language_match" not in md
    # a log whose records carry reply languages for some experiments only: said missing there
    with open(path, "a") as f:
        f.write("\n" + _line("new-1", "steered", "ja", "u1", reply_language=["ja"]))
    rep = build_report(read_log(path))
    lm = rep["experiments"]["e1"]["per_language"]["ko"]["metrics"]["language_match"]
    assert lm["status"] == "missing" and lm["mean"] == {"steered": None, "unsteered": None}
    assert "missing: no values here" in write_report(rep, tmp_path / "r2").read_text()


def test_a_language_the_steered_arm_did_not_steer_is_shown_and_left_out(tmp_path: Path) -> None:
    """Under ``auto`` English prompts are not steered (``applied: false``): per language "en"
    says the steered arm was not applied there, and the overall comparison is the languages it
    was applied in, never a silent pool of both."""
    path = tmp_path / "ab.jsonl"
    with open(path, "w") as f:
        for i in range(400):
            arm = "steered" if i % 2 else "unsteered"
            lang = "en" if i % 4 < 2 else "ja"
            applied = arm == "steered" and lang == "ja"
            f.write(_line(f"c{i}", arm, lang, f"u{i}", applied=applied, latency_ms=100.0))
            f.write(_fb(f"c{i}", float(i % 3 == 0)))
    exp = build_report(read_log(path))["experiments"]["e1"]
    en, ja = exp["per_language"]["en"], exp["per_language"]["ja"]
    assert exp["not_applied"] == ["en"]
    assert en["applied"] == {"steered_requests": 100, "applied": 0, "status": "not applied"}
    assert ja["applied"]["status"] == "applied"
    assert en["verdict"].startswith("steered arm not applied here")
    o = exp["overall"]
    assert o["arms"]["steered"]["requests"] == ja["arms"]["steered"]["requests"] == 100
    assert o["applied"]["status"] == "applied"
    md = (
        CliRunner().invoke(app_cli(), ["ab-report", str(path), "--out", str(tmp_path / "r")]).output
    )
    assert "Steered arm not applied in: en" in md and "- en: steered arm not applied here" in md


def test_a_winner_that_harms_a_guardrail_is_no_winner(tmp_path: Path) -> None:
    """Steered far better on feedback but 50 % slower: the guardrail holds the verdict back, and
    says which."""
    path = tmp_path / "ab.jsonl"
    with open(path, "w") as f:
        for i in range(600):
            arm = "steered" if i % 2 else "unsteered"
            ms = (150.0 if arm == "steered" else 100.0) * (1 + 0.1 * (i % 5))
            f.write(_line(f"c{i}", arm, "ja", f"u{i}", latency_ms=ms))
            f.write(_fb(f"c{i}", float(arm == "steered" or i % 4 == 0)))
    o = build_report(read_log(path))["experiments"]["e1"]["overall"]
    assert o["metrics"]["feedback"]["better"] == "steered"
    lat = o["metrics"]["latency_ms"]
    assert lat["harm"] and lat["difference"]["diff"] == pytest.approx(0.5, abs=0.01)
    assert o["winner"] is None and "worse on the guardrail latency_ms" in o["verdict"]


def test_report_json_keeps_the_winner_and_gains_per_metric_results(tmp_path: Path) -> None:
    path = tmp_path / "ab.jsonl"
    _log(path, 4000, 0.7, 0.5)
    out = CliRunner().invoke(
        app_cli(), ["ab-report", str(path), "--out", str(tmp_path / "r"), "--primary", "feedback"]
    )
    assert out.exit_code == 1, out.output  # the torn last line
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    exp = rep["experiments"]["e1"]
    assert exp["overall"]["winner"] == "steered"
    fb = exp["overall"]["metrics"]["feedback"]
    assert set(fb) >= {"n", "subjects", "mean", "difference", "fixed_horizon", "verdict", "needed"}
    # 2 metrics (feedback, latency_ms) x 3 groups (all, ja, ko)
    assert exp["family"]["method"] == "Bonferroni" and exp["family"]["size"] == 6
    seq = exp["sequence"]
    assert seq["metric"] == "feedback" and 2 <= len(seq["diff"]) <= 60
    assert all(lo <= d <= hi for d, lo, hi in zip(seq["diff"], seq["lo"], seq["hi"], strict=True))
    assert seq["lo"][-1] > 0  # the last look calls it
    assert {m["name"] for m in rep["metrics"]} >= {"feedback", "language_match", "pivot_leak"}
    assert "| feedback | all |" in out.output and "still needed" in out.output


def test_ab_report_on_a_missing_store_creates_nothing(tmp_path: Path) -> None:
    """Issue 58: ``ab-report sqlite:///missing.db`` says the store is not there (exit 2, named)
    and creates no file; a missing log file the same."""
    missing = tmp_path / "missing.db"
    out = CliRunner().invoke(app_cli(), ["ab-report", f"sqlite:///{missing}"])
    assert out.exit_code == 2 and "no such file" in out.output, out.output
    assert "missing.db" in out.output
    assert not list(tmp_path.iterdir())
    out = CliRunner().invoke(app_cli(), ["ab-report", str(tmp_path / "nope.jsonl")])
    assert out.exit_code == 2 and "no such file" in out.output and not list(tmp_path.iterdir())
    out = CliRunner().invoke(app_cli(), ["ab-report", str(tmp_path), "--primary", "nope"])
    assert out.exit_code == 2


def app_cli():  # noqa: ANN201
    from steerserve.cli import app

    return app
