"""Experiments as records without a server: the registry in a real SQLite store (created,
joined, ramped, stopped and started; other arms refused), replicas following it, phases in a
JSONL log, paired preferences, the backlog's retryable 503 and a dead process's write-ahead
file replayed. (PostgreSQL, the race between replicas and a real ``kill -9``:
tests/server/ab/test_ab_store.py.)"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from steerserve.server.ab import analysis, service
from steerserve.server.ab.design import STOPPED, Design, DesignError, parse_allocation, parse_arm
from steerserve.server.ab.experiment import (
    PAIR,
    DecisionLog,
    Decisions,
    Experiment,
    FeedbackLimit,
    WrongKind,
)
from steerserve.server.ab.metrics import MetricError, feedback_metric
from steerserve.server.ab.registry import Registry
from steerserve.server.ab.store import experiments, open_store, open_writer
from steerserve.server.errors import ApiError

USERS = [f"user-{i}" for i in range(300)]
LOW = "control=0.8,v1=0.1,v2=0.1"
HIGH = "control=0.5,v1=0.25,v2=0.25"


def design(name: str = "ramp", v2: str = "auto") -> Design:
    arms = (parse_arm("control=off"), parse_arm("v1=on"), parse_arm(f"v2={v2}"))
    return Design(name, arms, "control")


def replica(url: str, tmp: Path, shares: str, log: Path | None = None, **kw: Any) -> Decisions:
    """One server process: its writer on the store, its experiment created or joined."""
    d = Decisions(DecisionLog(log), open_writer(url, str(tmp / "spill")))
    des = kw.get("design") or design()
    exp = Experiment(design=des, allocation=parse_allocation([shares], des))
    d.registry = Registry(exp, d.store, d.log, kw.get("by", "test"))
    d.registry.join()
    return d


def answer(d: Decisions, rid: str, user: str) -> str:
    a = d.registry.experiment.assign(user)
    d.record(rid, {"experiment": a.name, "arm": a.arm, "subject_hash": a.subject_hash,
                   "phase": a.phase, "language": "fr", "applied": a.arm != "control",
                   "reply_language": ["fr"], "finish_reason": ["stop"]})  # fmt: skip
    return a.arm


@contextmanager
def locked(url: str) -> Iterator[None]:
    """The SQLite store's write lock held by another connection (a real outage for writers)."""
    c = sqlite3.connect(url.split(":///", 1)[1], isolation_level=None)
    c.execute("BEGIN EXCLUSIVE")
    try:
        yield
    finally:
        c.execute("ROLLBACK")
        c.close()


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/ab.db"


def test_create_join_ramp_and_refuse_other_arms(url: str, tmp_path: Path) -> None:
    a = replica(url, tmp_path, LOW)
    b = replica(url, tmp_path, LOW)  # the same flags: joins phase 1
    assert b.registry.experiment.phase.number == 1
    ramp = replica(url, tmp_path, HIGH, by="serve on host:2")  # a ramp: phase 2, logged why
    ph = ramp.registry.experiment.phases
    assert [p.number for p in ph] == [1, 2] and ph[0].ended == ph[1].started
    assert ph[1].why.startswith("allocation changed by serve on host:2: control 0.8 -> 0.5, v1")
    for d in (a, b):  # the others follow the record
        d.registry.refresh()
        assert d.registry.experiment.phase.number == 2
    assert {d.registry.experiment.assign(u).arm for d in (a, b, ramp) for u in USERS[:1]}
    for u in USERS:
        assert len({d.registry.experiment.assign(u).arm for d in (a, b, ramp)}) == 1
    store = open_store(url)
    with pytest.raises(experiments.Conflict, match=r"arm v2 is on here, auto there"):
        experiments.ensure(store, design(v2="on"), parse_allocation([HIGH], design()), "", "x")
    assert len(experiments.load(store, "ramp").phases) == 2  # nothing written
    with pytest.raises(DesignError, match="keeps its control"):
        other = Design(
            "ramp", (parse_arm("v1=on"), parse_arm("control=off"), parse_arm("v2=auto")), "v1"
        )
        experiments.set_status(store, "ramp", STOPPED, "", "x")
        experiments.ensure(store, other, {"v1": 0.5, "control": 0.25, "v2": 0.25}, "", "x")
    got = experiments.ensure(store, design(v2="on"), parse_allocation([HIGH], design()), "", "x")
    assert got.event == "phase 3" and got.status == "running"  # stopped: new arms, new phase
    assert "arms changed" in got.phase.why
    store.close()
    for d in (a, b, ramp):
        d.close()


def test_admin_changes_are_phases_every_replica_follows(url: str, tmp_path: Path) -> None:
    a, b = replica(url, tmp_path, LOW), replica(url, tmp_path, LOW)
    with pytest.raises(DesignError, match="sum to 0.9"):
        a.registry.change({"control": 0.7, "v1": 0.1, "v2": 0.1}, "", "admin")
    a.registry.change({"control": 0.5, "v1": 0.25, "v2": 0.25}, "the ramp", "admin")
    a.registry.set_status(STOPPED, "enough", "admin")
    b.registry.refresh()
    exp = b.registry.experiment
    assert exp.status == STOPPED and [p.why for p in exp.phases][1] == "the ramp (by admin)"
    assert exp.phase.ended is not None
    b.registry.set_status("running", "", "admin")
    a.registry.refresh()
    assert a.registry.experiment.phase.number == 3 and a.registry.experiment.running
    assert a.registry.experiment.phase.allocation == exp.phases[1].allocation
    # a replica restarting with its old flags joins: the admin's allocation stands
    c = replica(url, tmp_path, LOW)
    assert c.registry.experiment.phase.number == 3
    for d in (a, b, c):
        d.close()


def test_two_replicas_a_ramp_and_the_report_per_phase_without_a_split(
    url: str, tmp_path: Path
) -> None:
    """The acceptance's shape in one process: two replicas, three arms, a ramp 0.2 -> 0.5;
    the report has two phases, each with its allocation and SRM check, and no pooled
    difference (the experiment's numbers are its latest phase's)."""
    a, b = replica(url, tmp_path, LOW), replica(url, tmp_path, LOW)
    for i, u in enumerate(USERS):
        assert answer(a, f"p1-a-{i}", u) == answer(b, f"p1-b-{i}", u)
    a.registry.change(dict(parse_allocation([HIGH], design())), "ramp", "admin")
    b.registry.refresh()
    for i, u in enumerate(USERS):
        assert answer(a, f"p2-a-{i}", u) == answer(b, f"p2-b-{i}", u)
    for d in (a, b):
        assert d.store.flush(60)
        d.close()
    rep = analysis.report(url)
    exp = rep["experiments"]["ramp"]
    assert [p["phase"] for p in exp["phases"]] == [1, 2]
    for p, shares in zip(exp["phases"], (LOW, HIGH), strict=True):
        assert p["allocation"] == parse_allocation([shares], design())
        assert p["requests"] == 600 and p["srm"]["checked"] and not p["srm"]["flagged"]
        assert p["srm"]["subjects_in_both_arms"] == 0  # sticky within the phase
    assert exp["phase"] == 2 and exp["overall"]["arms"]["control"]["requests"] < 600
    assert set(exp["overall"]["comparisons"]) == {"v1", "v2"}
    assert exp["family"]["treatments"] == 2
    md = analysis.report_markdown(rep)
    assert "### Phase 1 (control 0.8, v1 0.1, v2 0.1)" in md and "### Phase 2" in md


def test_a_log_keeps_its_phases_and_reports_them(tmp_path: Path) -> None:
    log = tmp_path / "ab.jsonl"
    d = Decisions(DecisionLog(log))
    des = design("local")
    exp = Experiment(design=des, allocation=parse_allocation([LOW], des))
    d.registry = Registry(exp, None, d.log, "test")
    assert d.registry.join() == "created"
    for i, u in enumerate(USERS):
        answer(d, f"a{i}", u)
    d.log.close()
    again = Decisions(DecisionLog(log))  # a restart with a ramp: phase 2 in the same log
    exp = Experiment(design=des, allocation=parse_allocation([HIGH], des))
    again.registry = Registry(exp, None, again.log, "test")
    assert again.registry.join() == "phase 2"
    for i, u in enumerate(USERS):
        answer(again, f"b{i}", u)
    again.log.close()
    rep = analysis.report(log)["experiments"]["local"]
    assert [(p["phase"], p["requests"]) for p in rep["phases"]] == [(1, 300), (2, 300)]
    assert all(p["srm"]["checked"] for p in rep["phases"])


def test_preferences_are_bounded_per_pair_and_refused_elsewhere(url: str, tmp_path: Path) -> None:
    for d in (Decisions(DecisionLog(tmp_path / "p.jsonl")), replica(url, tmp_path, LOW)):
        pair = {"experiment": "ramp", "arm": PAIR, "subject_hash": "s1", "language": "ja",
                "treatment": "v1x1"}  # fmt: skip
        d.record("chatcmpl-x", pair)
        d.record("chatcmpl-y", {"experiment": "ramp", "arm": "control"})
        if d.store is not None:
            assert d.store.flush(30)
        got = asyncio.run(service.preference(d, "chatcmpl-x-b", "b"))
        assert got["id"] == "chatcmpl-x" and got["score"] == 1.0 and got["language"] == "ja"
        with pytest.raises(FeedbackLimit):
            d.feedback("chatcmpl-x", -1.0, "preference")
        with pytest.raises(WrongKind, match="is not a pair"):
            d.feedback("chatcmpl-y", 1.0, "preference")
        with pytest.raises(WrongKind, match="is a pair"):
            d.feedback("chatcmpl-x", 1.0)
        with pytest.raises(ApiError) as e:
            asyncio.run(service.preference(d, "chatcmpl-x", "tie"))
        assert e.value.status == 409 and e.value.code == "preference_limit"
        with pytest.raises(ApiError) as e:  # a preference is not posted as feedback
            service.feedback(d, "chatcmpl-y", 1.0, "preference")
        assert e.value.status == 400 and e.value.param == "id"
        with pytest.raises(MetricError, match="POST /v1/steering/preference"):
            feedback_metric("preference")
        d.close()
    rep = analysis.report(url)
    pref = rep["preferences"]["ramp"]["treatments"]["v1x1"]["overall"]
    assert (pref["judged"], pref["b"], pref["a"], pref["tie"]) == (1, 1, 0, 0)


def test_a_dead_processs_write_ahead_file_is_replayed_once_and_a_torn_line_counted(
    url: str, tmp_path: Path
) -> None:
    """A write-ahead file nobody holds (its process died: the kernel let go of its lock) is
    claimed by the next writer, its records written once (one was in the store already), the
    line a crash tore counted as dropped, the dead replica's row marked recovered."""
    a = replica(url, tmp_path, LOW)
    answer(a, "before", USERS[0])
    assert a.store.flush(30)
    a.close()
    spill = tmp_path / "spill"
    key = hashlib.sha256(url.encode()).hexdigest()[:12]  # the writer's name for this store
    dead = spill / f"ab-wal-{key}-1-999.jsonl"
    recs = [{"type": "wal", "replica": "deadhost:1"}]
    recs.append({"type": "decision", "ts": 1.0, "id": "before", "experiment": "ramp", "arm": "v1"})
    recs += [{"type": "decision", "ts": 2.0 + i, "id": f"lost-{i}", "experiment": "ramp",
              "arm": "control", "phase": 1} for i in range(3)]  # fmt: skip
    recs.append({"type": "feedback", "ts": 9.0, "id": "lost-1", "score": 1.0, "fid": "f1"})
    dead.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"type": "decis')
    with open_store(url) as s, s._tx() as cur:
        cur.execute("INSERT INTO steerserve_ab_replicas (replica, started, seen, written, queued,"
                    " dropped) VALUES ('deadhost:1', 0, 0, 0, 4, 0)")  # fmt: skip
    b = replica(url, tmp_path, LOW)
    assert b.store.flush(30)
    b.close()
    rows = {r["replica"]: r for r in open_store(url, migrate=False).replicas()}
    assert rows["deadhost:1"]["status"] == "recovered" and rows["deadhost:1"]["queued"] == 0
    assert sum(int(r["dropped"]) for r in rows.values()) == 1  # the torn line
    assert not dead.exists()
    rep = analysis.report(url)
    assert (
        rep["requests"] == 4 and rep["store"]["dropped"] == 1 and rep["store"]["unaccounted"] == 0
    )
    assert rep["store"]["written"] == sum(int(r["written"]) for r in rows.values())


def test_the_page_shows_the_last_report_read_with_its_age_while_the_store_is_down(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``/experiments``' data while the store cannot be read: the last report read, said stale,
    with the time it was read (the page shows its age), never an empty page."""
    import time
    from types import SimpleNamespace

    from steerserve.server import pages
    from steerserve.server.ab.experiment import StoreUnavailable

    d = replica(url, tmp_path, LOW)
    answer(d, "r1", USERS[0])
    assert d.store.flush(30)
    state = SimpleNamespace(decisions=d, metrics=SimpleNamespace(ab_requests=SimpleNamespace(
        collect=lambda: [])))  # fmt: skip
    t0 = time.time()
    up = pages.snapshot(state)
    assert up["report"]["requests"] == 1 and not up["report_stale"]

    def down(source: Any) -> Any:
        raise StoreUnavailable("connection refused")

    monkeypatch.setattr(pages, "_report", down)
    snap = pages.snapshot(state)
    assert snap["report_stale"] and snap["store"]["read_error"] == "connection refused"
    assert snap["report"] == up["report"] and t0 <= snap["report_read_at"] <= time.time()
    d.close()
