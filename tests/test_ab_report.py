"""`steerserve ab-report` on generated logs: a known difference lies inside its CI, small samples
call no winner."""

from __future__ import annotations

import json
import random
from pathlib import Path

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
    lo, hi = exp["difference"]["ci95"]
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
