"""The A/B experiment's parts without a server: sticky assignment, the decision log (a full disk
included) and feedback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from steerserve.server.ab.experiment import DecisionLog, DecisionNotLogged, Decisions, Experiment


def test_assignment_is_sticky_balanced_and_reshuffled_by_name() -> None:
    exp = Experiment("exp-1", 0.5)
    users = [f"user-{i}" for i in range(2000)]
    arms = [exp.assign(u).arm for u in users]
    fresh, renamed = Experiment("exp-1", 0.5), Experiment("exp-2", 0.5)  # one each: 7 ms a build
    assert arms == [fresh.assign(u).arm for u in users]
    steered = arms.count("steered")
    assert 900 <= steered <= 1100  # binomial(2000, 0.5): mean 1000, sd 22
    other = [renamed.assign(u).arm for u in users]
    assert 0.4 < sum(a != b for a, b in zip(arms, other, strict=True)) / len(users) < 0.6
    everyone, tenth = Experiment("x", 1.0), Experiment("x", 0.1)
    assert all(everyone.assign(u).arm == "steered" for u in users[:50])
    assert 150 <= [tenth.assign(u).arm for u in users].count("steered") <= 250
    assert exp.assign("a").subject_hash != exp.assign("b").subject_hash


@pytest.mark.parametrize("split", [-0.1, 1.5, float("nan")])
def test_split_outside_unit_interval_is_refused(split: float) -> None:
    with pytest.raises(ValueError, match="--ab-split"):
        Experiment("x", split)


def test_unwritable_log_is_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="--ab-log"):
        DecisionLog(blocker / "log.jsonl")


def test_decisions_log_feedback_and_survive_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "ab.jsonl"
    d = Decisions(DecisionLog(path))
    assert d.record("id-1", {"experiment": "e", "arm": "steered", "prompt": "secret"})
    d.feedback("id-1", 1.0)
    with pytest.raises(KeyError):
        d.feedback("nope", 1.0)
    with pytest.raises(ValueError, match="score"):
        d.feedback("id-1", float("inf"))
    with pytest.raises(ValueError, match="score"):
        d.feedback("id-1", True)  # type: ignore[arg-type]
    d.log.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["type"] for x in lines] == ["decision", "feedback"]
    assert "prompt" not in lines[0]  # content only with --ab-log-content
    again = Decisions(DecisionLog(path))  # a restarted server knows the old ids
    assert again.get("id-1") == {"experiment": "e", "arm": "steered", "language": None}
    again.feedback("id-1", 0.0)


def test_content_is_logged_only_when_asked(tmp_path: Path) -> None:
    path = tmp_path / "ab.jsonl"
    d = Decisions(DecisionLog(path, content=True))
    d.record("id-1", {"arm": "steered", "prompt": "p", "reply": "r"})
    d.log.close()
    assert json.loads(path.read_text())["reply"] == "r"


def test_full_disk_is_counted_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    log = DecisionLog("/dev/full")
    d = Decisions(log)
    assert d.record("a", {"arm": "steered"}) is False
    assert d.record("b", {"arm": "steered"}) is False
    assert log.failures == 2
    assert sum("write failed" in r.message for r in caplog.records) == 1  # logged once
    with pytest.raises(DecisionNotLogged):  # never logged: a score for it could never be joined
        d.feedback("a", 1.0)
    assert log.failures == 2  # nothing written, nothing more lost
