"""Issue 56, item 2: the metric registry. Automatic metrics computed from what a decision record
says of its reply (language match, pivot leak, guardrails), feedback metrics posted by name, a
deployment's own metric added without touching the statistics, and bad feedback refused naming
its field with nothing written."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from steerserve.server.ab import metrics as ab_metrics
from steerserve.server.ab.analysis import build_report, read_log
from steerserve.server.ab.experiment import DecisionLog, Decisions
from steerserve.server.ab.metrics import Metric, MetricError


def test_every_row_says_what_it_measures_and_which_way_is_better() -> None:
    reg = ab_metrics.registry()
    assert list(reg)[:3] == ["feedback", "language_match", "pivot_leak"]
    for m in reg.values():
        assert m.what and m.direction in (-1, 1) and m.lo < m.hi, m
        assert (m.kind == ab_metrics.AUTOMATIC) == (m.compute is not None), m
        row = m.describe()
        assert row["direction"] in ("higher is better", "lower is better")
        json.dumps(row, allow_nan=False)  # an unbounded range is said as null
    guardrails = {m.name for m in reg.values() if m.role == ab_metrics.GUARDRAIL}
    assert guardrails == {"latency_ms", "completion_tokens", "truncated", "failed"}


@pytest.mark.parametrize(
    ("prompt", "replies", "match", "leak"),
    [
        ("ja", ["ja"], 1.0, 0.0),
        ("ja", ["zh"], 0.0, 1.0),  # the pivot: a Japanese question answered in Chinese
        ("fr", ["en", "fr"], 0.5, 0.5),  # n = 2: one reply each way
        ("en", ["en"], 1.0, None),  # an English prompt: no pivot leak to measure
        ("ja", [None], None, None),  # the reply's language not detected: nothing measured
        (None, ["ja"], None, None),  # nor the prompt's
        ("ja", None, None, None),  # a log from before replies were detected: missing, not 0
    ],
)
def test_language_metrics_from_the_record(
    prompt: str | None, replies: list | None, match: float | None, leak: float | None
) -> None:
    rec = {"language": prompt} | ({} if replies is None else {"reply_language": replies})
    got = ab_metrics.automatic(rec)
    assert got.get("language_match") == match and got.get("pivot_leak") == leak


def test_guardrails_from_the_record() -> None:
    rec = {"latency_ms": 812.5, "completion_tokens": 40, "finish_reason": ["length", "stop"]}
    got = ab_metrics.automatic(rec)
    assert got == {"latency_ms": 812.5, "completion_tokens": 40.0, "truncated": 0.5, "failed": 0.0}
    assert ab_metrics.automatic({"latency_ms": math.nan, "finish_reason": ["error"]}) == {
        "failed": 1.0,
        "truncated": 0.0,
    }


@pytest.fixture
def judge(monkeypatch: pytest.MonkeyPatch) -> Iterator[Metric]:
    """A deployment's metric, registered for one test: a judge model's 1-5 rating."""
    monkeypatch.setattr(ab_metrics, "_registry", dict(ab_metrics.registry()))
    yield ab_metrics.register(
        Metric("judge", "a judge model's rating", +1, 1.0, 5.0, kind=ab_metrics.FEEDBACK)
    )


def _decisions(path: Path, n: int) -> Decisions:
    d = Decisions(DecisionLog(path))
    for i in range(n):
        arm = "steered" if i % 2 else "unsteered"
        d.record(
            f"c{i}",
            {"experiment": "e", "arm": arm, "subject_hash": f"u{i}", "language": "ja"},
        )
    return d


def test_a_deployments_metric_is_posted_by_name_and_reported(judge: Metric, tmp_path: Path) -> None:
    """The judge's scores go to the log under its name, the last per metric counts, and the
    report analyses it beside feedback with no change to the statistics."""
    log = tmp_path / "ab.jsonl"
    d = _decisions(log, 80)
    for i in range(80):
        d.feedback(f"c{i}", 1.0 + (i % 2) * 3, metric="judge")
        d.feedback(f"c{i}", float(i % 2), metric="feedback")
    d.feedback("c0", 2.0, metric="judge")  # a changed rating: the last counts
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert {x.get("metric") for x in lines if x["type"] == "feedback"} == {None, "judge"}
    rows = {r.id: r for r in read_log(log)}
    assert rows["c0"].values["judge"] == 2.0 and rows["c0"].score == 0.0
    exp = build_report(list(rows.values()))["experiments"]["e"]
    assert "judge" in exp["family"]["metrics"] and exp["primary"] == "feedback"
    assert exp["overall"]["metrics"]["judge"]["mean"]["steered"] == pytest.approx(4.0)


@pytest.mark.parametrize(
    ("metric", "score", "param"),
    [
        ("feedback", 2.0, "score"),  # out of [-1, 1]
        ("feedback", math.nan, "score"),
        ("feedback", True, "score"),
        ("nope", 1.0, "metric"),  # not in the registry
        ("language_match", 1.0, "metric"),  # the server measures it itself
        ("judge", 0.0, "score"),  # out of the judge's [1, 5]
    ],
)
def test_bad_feedback_names_its_field_and_writes_nothing(
    judge: Metric, tmp_path: Path, metric: str, score: float, param: str
) -> None:
    log = tmp_path / "ab.jsonl"
    d = _decisions(log, 2)
    before = log.read_bytes()
    with pytest.raises(MetricError) as e:
        d.feedback("c1", score, metric=metric)
    assert e.value.param == param and str(e.value).startswith(f"{param}: "), e.value
    assert log.read_bytes() == before


def test_register_refuses_a_taken_name_or_a_bad_row(judge: Metric) -> None:
    with pytest.raises(ValueError, match="registered already"):
        ab_metrics.register(Metric("feedback", "x", +1, 0.0, 1.0, kind=ab_metrics.FEEDBACK))
    with pytest.raises(ValueError, match="computes"):
        ab_metrics.register(Metric("auto_without_compute", "x", +1, 0.0, 1.0))
    with pytest.raises(ValueError, match="direction"):
        ab_metrics.register(Metric("sideways", "x", 0, 0.0, 1.0, kind=ab_metrics.FEEDBACK))


def test_a_log_line_for_an_unknown_metric_is_counted_not_guessed(tmp_path: Path) -> None:
    """A log written where a deployment metric was registered, read where it is not: its lines
    are counted and said, never mixed into another metric."""
    log = tmp_path / "ab.jsonl"
    _decisions(log, 2)
    with open(log, "a") as f:
        f.write(json.dumps({"type": "feedback", "id": "c1", "score": 3, "metric": "judge"}) + "\n")
    from steerserve.server.ab.records import scan_log

    rows, ignored = scan_log(log)
    assert ignored.unknown_metric == 1 and ignored.total == 1
    assert all("judge" not in r.values for r in rows)
