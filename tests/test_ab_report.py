"""`steerserve ab-report` on generated logs: a known difference lies inside its CI, small samples
call no winner."""

from __future__ import annotations

import json
import random
from pathlib import Path

from steerserve.ab_report import build_report, read_log, write_report


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
