"""The A/B experiment store (``--ab-store``) on real databases: a SQLite file, and a PostgreSQL
server this module starts itself (tests/_postgres.py; skipped, saying why, where none can run).

Most cases drive the store's classes directly (two writers on one store are two replicas); the
acceptance case runs two ``steerserve serve`` processes on the tiny model against one store,
on each backend."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from _postgres import Postgres, postgres_server
from _server import free_port
from typer.testing import CliRunner

from steerserve.cli import app
from steerserve.server.ab import analysis as ab_report
from steerserve.server.ab.experiment import (
    MAX_FEEDBACK_PER_ID,
    DecisionLog,
    DecisionNotLogged,
    Decisions,
    Experiment,
    FeedbackLimit,
    StoreUnavailable,
)
from steerserve.server.ab.store import open_store, open_writer, schema, shown
from steerserve.server.ab.store.writer import Writer
from steerserve.server.metrics import Metrics

BACKENDS = ["sqlite", "postgres"]


@pytest.fixture(scope="module")
def pg() -> Iterator[Postgres]:
    yield from postgres_server()


class Backend:
    """One test's store: its URL and a real outage (PostgreSQL stopped; SQLite's write lock
    held by another connection, as a long transaction of another process would)."""

    def __init__(self, kind: str, url: str, pg: Postgres | None) -> None:
        self.kind, self.url, self.pg = kind, url, pg

    @contextmanager
    def down(self) -> Iterator[None]:
        if self.pg is not None:
            self.pg.stop()
            try:
                yield
            finally:
                self.pg.start()
            return
        path = self.url.split(":///", 1)[1]
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN EXCLUSIVE")
        try:
            yield
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "sqlite":
        return Backend("sqlite", f"sqlite:///{tmp_path}/ab.db", None)
    pg: Postgres = request.getfixturevalue("pg")
    name = "".join(c if c.isalnum() else "_" for c in request.node.name).lower()[:60]
    return Backend("postgres", pg.database(name), pg)


def decision(user: str, i: int, exp: Experiment) -> dict[str, Any]:
    """What the server records for an answered enrolled request."""
    a = exp.assign(user)
    return {
        "experiment": a.name,
        "arm": a.arm,
        "subject_hash": a.subject_hash,
        "endpoint": "chat",
        "model": "tiny",
        "language": ["fr", "ja"][i % 2],
        "applied": a.arm == "steered",
        "vectors": ["tiny/v1/recall"] if a.arm == "steered" else [],
        "prompt": [f"question {i} a\ud800b"],  # a lone surrogate: kept as the log keeps it
        "reply": [f"reply {i}"],
        "latency_ms": 10.0 + i,
        "prompt_tokens": 7,
        "completion_tokens": i % 5,
    }


def replica(url: str, log: Path | None = None, **kw: Any) -> Decisions:
    """One server process's decisions on the store at ``url`` (``log``: its JSONL export)."""
    return Decisions(DecisionLog(log, content=True), open_writer(url, kw.get("spill"), Metrics()))


def counts(url: str) -> tuple[int, int]:
    """Decisions and feedback rows in the store."""
    with open_store(url, migrate=False) as store:
        recs = list(store.records())
    return sum(r["type"] == "decision" for r in recs), sum(r["type"] == "feedback" for r in recs)


def sample(metric: Any) -> float:
    """A metric's value (a counter's ``_total``)."""
    samples = [s for m in metric.collect() for s in m.samples]
    return next(s.value for s in samples if not s.name.endswith("_created"))


def said(output: str) -> str:
    """A CLI's message as one line: rich's box and its line breaks taken out."""
    return " ".join(output.replace("│", " ").split())


# --- schema -------------------------------------------------------------------------------------


def test_schema_is_created_and_migrated_once(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replicas starting together create the schema once (a version table says which); a new
    version is applied once by whichever starts first; a schema newer than the code is refused
    in words, so an old server never writes to it."""
    with ThreadPoolExecutor(4) as pool:
        stores = list(pool.map(lambda _: open_store(backend.url), range(4)))
    assert {s.version() for s in stores} == {len(schema.MIGRATIONS)}
    for s in stores:
        s.close()
    upgrade = [*schema.MIGRATIONS, ["CREATE TABLE steerserve_ab_probe (x INTEGER)"]]
    monkeypatch.setattr(schema, "MIGRATIONS", upgrade)
    with ThreadPoolExecutor(3) as pool:  # two creating the table at once: "already exists"
        stores = list(pool.map(lambda _: open_store(backend.url), range(3)))
    assert {s.version() for s in stores} == {len(upgrade)}
    for s in stores:
        s.close()
    monkeypatch.undo()
    now = len(schema.MIGRATIONS)
    with pytest.raises(
        ValueError, match=rf"newer than this steerserve's {now}: upgrade steerserve"
    ):
        open_store(backend.url)


def test_a_version_1_store_migrates_and_its_feedback_is_the_human_score(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 56: a store written before feedback named its metric (schema 1) is migrated by the
    next start (the ``metric`` column added), and its old scores read back as ``feedback``."""
    monkeypatch.setattr(schema, "MIGRATIONS", schema.MIGRATIONS[:1])
    with open_store(backend.url) as old, old._tx() as cur:
        rec = decision("carol", 0, Experiment("old", 0.5))
        cur.execute(  # a decision as schema 1 had it (no phase)
            f"INSERT INTO {schema.DECISIONS} (id, ts, experiment, arm, subject_hash, language, "
            "replica) VALUES (?, ?, ?, ?, ?, ?, ?)",
            ("c0", 1.0, "old", rec["arm"], rec["subject_hash"], rec["language"], "r"),
        )
        cur.execute(
            f"INSERT INTO {schema.FEEDBACK} (fid, id, ts, score, replica) VALUES (?, ?, ?, ?, ?)",
            ("f0", "c0", 2.0, 1.0, "r"),
        )
    monkeypatch.undo()
    with open_store(backend.url) as store:
        assert store.version() == len(schema.MIGRATIONS)  # every migration since, in order
        fb = [r for r in store.records() if r["type"] == "feedback"]
        assert fb == [{"type": "feedback", "ts": 2.0, "id": "c0", "score": 1.0}]
        rows = ab_report.report(store)["experiments"]["old"]["overall"]["arms"]
    assert sum(a["score"]["n"] for a in rows.values()) == 1


# --- records and reports --------------------------------------------------------------------------


def test_two_replicas_one_store_join_feedback_and_report(backend: Backend, tmp_path: Path) -> None:
    """Two replicas record their answers; feedback for each answer goes to the other one and is
    joined (the arm comes back); every field of every record is in the store as the JSONL
    exports have it; the store's report equals the report of both replicas' logs together."""
    exp = Experiment("two", 0.5)
    logs = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    a, b = (replica(backend.url, log) for log in logs)
    ids: dict[str, tuple[Decisions, str]] = {}
    for i in range(40):
        mine, other = (a, b) if i % 2 else (b, a)
        rec = decision(f"user-{i}", i, exp)
        assert mine.record(f"id-{i}", rec)
        ids[f"id-{i}"] = (other, rec["arm"])
    for d in (a, b):  # (the server asks again for an id not written yet: tested with servers)
        assert d.store.flush(60)
    for rid, (other, arm) in list(ids.items())[:30]:
        got = other.feedback(rid, 1.0 if arm == "steered" else 0.0)
        assert got == {"experiment": "two", "arm": arm, "language": got["language"]}
    with pytest.raises(KeyError):
        a.feedback("chatcmpl-nobody-answered", 1.0)
    for d in (a, b):
        assert d.store.flush(60)
        d.close()
    stored = {r["id"]: r for r in open_store(backend.url, migrate=False).records() if "arm" in r}
    lines = [json.loads(x) for log in logs for x in log.read_text().splitlines()]
    for line in (x for x in lines if x["type"] == "decision"):
        assert {k: stored[line["id"]].get(k) for k in line} == line
    together = tmp_path / "all.jsonl"
    together.write_text("".join(log.read_text() for log in logs))
    from_store = ab_report.report(backend.url, min_n=2, splits={"two": 0.5})
    from_logs = ab_report.report(together, min_n=2, splits={"two": 0.5})
    assert from_store.pop("store") == {
        "url": shown(backend.url),
        "replicas": 2,
        "written": 70,
        "queued": 0,
        "dropped": 0,
        "unaccounted": 0,
        "unaccounted_replicas": [],
    }
    assert from_store == from_logs
    assert from_store["requests"] == 40
    arms = from_store["experiments"]["two"]["overall"]["arms"]
    assert arms["steered"]["score"]["n"] + arms["unsteered"]["score"]["n"] == 30


CAP_SCRIPT = """
import sys
from steerserve.server.ab.store import open_writer
from steerserve.server.ab.experiment import DecisionLog, Decisions, FeedbackLimit
url, rid, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
d = Decisions(DecisionLog(None), open_writer(url, None))
print("ready", flush=True)
sys.stdin.readline()
ok = limited = 0
for i in range(n):
    try:
        d.feedback(rid, 1.0 if i % 2 else 0.0)
        ok += 1
    except FeedbackLimit:
        limited += 1
d.close()
print(ok, limited, flush=True)
"""


def test_feedback_cap_holds_across_processes(backend: Backend) -> None:
    """Two processes (replicas) score one answer 10 times each, at the same moment: the store
    takes exactly MAX_FEEDBACK_PER_ID scores, the rest are refused as over the cap."""
    d = replica(backend.url)
    assert d.record("shared", {"experiment": "cap", "arm": "steered"})
    assert d.store.flush(60)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CAP_SCRIPT, backend.url, "shared", "10"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for p in procs:  # both have the store open before either starts
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    results = [tuple(map(int, p.communicate(timeout=300)[0].split())) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sum(ok for ok, _ in results) == MAX_FEEDBACK_PER_ID, results
    assert sum(limited for _, limited in results) == 20 - MAX_FEEDBACK_PER_ID
    assert counts(backend.url) == (1, MAX_FEEDBACK_PER_ID)
    with pytest.raises(FeedbackLimit):  # and for this replica too, which answered it
        d.feedback("shared", 1.0)
    d.close()


# --- outages ------------------------------------------------------------------------------------


def test_store_stopped_mid_load_loses_nothing(backend: Backend) -> None:
    """The database goes away in the middle of a load: every request is still answered at once
    (a record only queues), feedback on this replica's answers queues behind them, feedback it
    cannot check is a clear StoreUnavailable; when the database is back the queue is written in
    order and the counts match exactly."""
    metrics = Metrics()
    d = Decisions(DecisionLog(None), open_writer(backend.url, None, metrics))
    exp = Experiment("outage", 0.5)
    slowest = 0.0

    def load(lo: int, hi: int) -> None:
        nonlocal slowest
        with ThreadPoolExecutor(8) as pool:
            for took in pool.map(lambda i: timed(d.record, f"id-{i}", decision(f"u{i}", i, exp)),
                                 range(lo, hi)):  # fmt: skip
                slowest = max(slowest, took)

    load(0, 100)
    with backend.down():
        load(100, 300)
        probed = False
        while d.store.up:  # until the writer found the outage (its next write failed)
            probed = d.record("probe", decision("probe", 0, exp))
            time.sleep(0.05)
        for i in range(100, 120):  # this replica answered them: queued behind their decisions
            assert d.feedback(f"id-{i}", 1.0)["arm"] == exp.assign(f"u{i}").arm
        with pytest.raises(StoreUnavailable):  # an id it cannot check now
            d.feedback("someone-elses", 1.0)
        assert d.store.queued > 0 and sample(metrics.ab_store_up) == 0
        assert sample(metrics.ab_store_queued) == d.store.queued
    assert d.store.flush(120), "the queue did not drain once the store was back"
    n = 300 + probed  # the probe: the same id each time, one decision
    assert counts(backend.url) == (n, 20)
    total = d.store.written
    d.close()
    assert slowest < 1.0, f"a record took {slowest:.3f} s while the store was down"
    assert d.store.dropped == 0 and sample(metrics.ab_store_dropped) == 0
    assert sample(metrics.ab_store_written) == total and sample(metrics.ab_store_queued) == 0
    assert sample(metrics.ab_store_up) == 1


def timed(f: Any, *args: Any) -> float:
    t = time.perf_counter()
    assert f(*args) is True  # never refused, never raised
    return time.perf_counter() - t


def test_a_full_queue_drops_counted_and_reported(backend: Backend, tmp_path: Path) -> None:
    """Past the queue's bound a record is dropped: counted in the metric and, once the store is
    back, in the replica's row, so ab-report says so (and exits 1); feedback for a dropped
    decision is refused as never logged."""
    metrics = Metrics()
    writer = Writer(open_store(backend.url), None, metrics, max_queued=5)
    d = Decisions(DecisionLog(None), writer)
    with backend.down():
        d.record("first", {"experiment": "full", "arm": "steered"})
        while writer.up:  # the first write found the outage
            time.sleep(0.05)
        kept = [d.record(f"id-{i}", {"experiment": "full", "arm": "unsteered"}) for i in range(8)]
        assert kept == [True] * 4 + [False] * 4
        assert sample(metrics.ab_store_dropped) == 4
        with pytest.raises(DecisionNotLogged):
            d.feedback("id-7", 1.0)
    assert writer.flush(120)
    d.close()
    with open_store(backend.url, migrate=False) as store:
        assert store.status()["dropped"] == 4
    out = CliRunner().invoke(app, ["ab-report", backend.url])
    assert out.exit_code == 1, out.output
    assert "4 record(s) dropped by the servers before they reached the store" in said(out.output)


def test_a_restart_keeps_the_queue(backend: Backend, tmp_path: Path) -> None:
    """Stopped while the store is unreachable, a server keeps its queue in a spill file; the
    next start writes it (once, even if the file is replayed again) and deletes the file."""
    spill = tmp_path / "spill"
    d = replica(backend.url, spill=spill)
    with backend.down():
        for i in range(10):
            d.record(f"id-{i}", {"experiment": "restart", "arm": "steered"})
        d.feedback("id-3", 1.0)
        d.store.close(timeout=0.5)
        (kept,) = spill.iterdir()  # the write-ahead file is gone: the spill holds the queue
        assert len(kept.read_text().splitlines()) == 1 + 11 and d.store.dropped == 0
        shutil.copy(kept, tmp_path / "copy")
    again = replica(backend.url, spill=spill)
    assert again.store.flush(120)
    again.close()
    assert counts(backend.url) == (10, 1) and list(spill.iterdir()) == []
    shutil.copy(tmp_path / "copy", kept)  # the same records replayed twice: written once
    third = replica(backend.url, spill=spill)
    assert third.store.flush(120)
    third.close()
    assert counts(backend.url) == (10, 1)


# --- the race between replicas, a backlog, a killed replica -------------------------------------


def _decided_by_two_statements(store: Any, cur: Any, rec: dict[str, Any], replica: str) -> Any:
    """The feedback path before issue 57: an UPDATE that found no row, then a SELECT to tell an
    unknown id from a full cap (under READ COMMITTED, each sees its own moment)."""
    from steerserve.server.ab.store.schema import DECISIONS

    rid = str(rec["id"])
    cur.execute(
        f"UPDATE {DECISIONS} SET feedback_count = feedback_count + 1 "
        "WHERE id = ? AND feedback_count < ? RETURNING experiment",
        (rid, MAX_FEEDBACK_PER_ID),
    )
    if cur.fetchone() is None:
        cur.execute(f"SELECT 1 FROM {DECISIONS} WHERE id = ?", (rid,))
        raise KeyError(rid) if cur.fetchone() is None else FeedbackLimit(rid)
    return {}, True


def test_a_decision_committed_between_a_feedbacks_statements_is_not_over_the_cap(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 57's false 429: replica b takes feedback for an answer of replica a while a commits
    the answer's decision, driven deterministically: a's commit runs right after b's first
    statement. b's feedback is "not there yet" (the server asks again, then joins it), never
    over the cap, and the retry is written once. The same interleaving through the old
    two-statement path calls that first score over the cap on PostgreSQL (READ COMMITTED);
    SQLite's write lock keeps a's commit out until b's transaction ends."""
    from steerserve.server.ab.store import base

    a, b = replica(backend.url), replica(backend.url)
    rec = decision("carol", 0, Experiment("race", 0.5))
    real, fired = base._Cursor.execute, []

    def commit_a_midway(self: Any, sql: str, params: Any = ()) -> None:
        real(self, sql, params)
        mine = threading.current_thread() is threading.main_thread()
        if mine and not fired and "steerserve_ab_decisions" in sql and "INSERT" not in sql:
            fired.append(sql)
            a.record(f"raced-{len(results)}", rec)
            fired.append(a.store.flush(3))  # PostgreSQL: committed; SQLite: b holds the lock

    results: list[str] = []
    monkeypatch.setattr(base._Cursor, "execute", commit_a_midway)
    for path in ("locked read", "two statements"):
        fired.clear()
        if path == "two statements":
            monkeypatch.setattr(
                b.store.store,
                "_feedback",
                lambda cur, r, n: _decided_by_two_statements(b.store.store, cur, r, n),
            )
        try:
            b.feedback(f"raced-{len(results)}", 1.0)
            results.append("joined")
        except KeyError:
            results.append("not found yet")
        except FeedbackLimit:
            results.append("over the cap")
        assert fired and fired[1] is (backend.kind == "postgres"), fired
    monkeypatch.undo()
    assert results[0] == "not found yet"
    assert results[1] == ("over the cap" if backend.kind == "postgres" else "not found yet")
    assert a.store.flush(60)
    assert b.feedback("raced-0", 1.0)["experiment"] == "race"  # the server's retry: joined
    with open_store(backend.url, migrate=False) as store, store._tx() as cur:
        cur.execute("SELECT feedback_count FROM steerserve_ab_decisions WHERE id = 'raced-0'")
        assert cur.fetchone()[0] == 1
    assert counts(backend.url) == (2, 1)
    a.close()
    b.close()


def test_feedback_behind_another_replicas_backlog_is_a_retryable_503(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After an outage replica a's queue drains in batches; b, asked for feedback on an answer
    still in a's queue, says 503 with Retry-After (a reports its backlog), never 404; once a's
    queue is written, b joins the same feedback."""
    import asyncio
    import threading

    from steerserve.server.ab import service
    from steerserve.server.ab.store import writer as writer_mod
    from steerserve.server.errors import ApiError

    a, b = replica(backend.url), replica(backend.url)
    monkeypatch.setattr(writer_mod, "BATCH", 1)
    held, real, calls = threading.Event(), a.store.store.write, []

    def behind(batch: Any, rep: Any) -> Any:
        calls.append(1)
        if len(calls) > 1:
            held.wait(60)
        return real(batch, rep)

    monkeypatch.setattr(a.store.store, "write", behind)
    exp = Experiment("backlog", 0.5)
    for i in range(5):
        a.record(f"late-{i}", decision(f"u{i}", i, exp))
    deadline = time.monotonic() + 60
    while not b.store.backlog() and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(ApiError) as e:
        asyncio.run(service.feedback_joined(b, "late-4", 1.0))
    assert (e.value.status, e.value.code, e.value.headers) == (
        503, "decision_pending", {"Retry-After": "2"},
    )  # fmt: skip
    held.set()
    assert a.store.flush(60)
    assert asyncio.run(service.feedback_joined(b, "late-4", 1.0))["experiment"] == "backlog"
    with pytest.raises(ApiError) as e:  # nobody's backlog, nobody's answer: 404 after the grace
        asyncio.run(service.feedback_joined(b, "nobody", 1.0))
    assert e.value.status == 404
    a.close()
    b.close()


KILL_SCRIPT = """
import sys, time
from steerserve.server.ab.store import open_writer
from steerserve.server.ab.experiment import DecisionLog, Decisions
d = Decisions(DecisionLog(None), open_writer(sys.argv[1], sys.argv[2]))
print("ready", flush=True)
sys.stdin.readline()  # the store is down from here
for i in range(60):
    print("decision", i, d.record(f"k{i}", {"experiment": "kill", "arm": "steered"}), flush=True)
for i in range(0, 60, 6):  # this replica's own answers: queued behind their decisions
    print("feedback", i, d.feedback(f"k{i}", 1.0)["arm"], flush=True)
print("done", d.store.queued, flush=True)
time.sleep(600)
"""


def test_a_replica_killed_during_an_outage_loses_nothing_it_acknowledged(
    backend: Backend, tmp_path: Path
) -> None:
    """A replica answers 60 requests and 10 feedbacks while the store is down (all queued),
    then is killed with SIGKILL; the next process on its folder replays its write-ahead file:
    every acknowledged record is in the store, the report counts nothing dropped or
    unaccounted, and the dead replica's row says it was recovered."""
    import signal

    spill = tmp_path / "spill"
    child = subprocess.Popen(
        [sys.executable, "-c", KILL_SCRIPT, backend.url, str(spill)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        assert child.stdout.readline().strip() == "ready"
        with backend.down():
            child.stdin.write("go\n")
            child.stdin.flush()
            said = []
            while not (line := child.stdout.readline()).startswith("done"):
                said.append(line.split())
            child.send_signal(signal.SIGKILL)
            child.wait(60)
        acked = [w for w in said if w[2] in ("True", "steered")]
        assert len(acked) == 70 and line.split()[1] == "70"  # all still queued when killed
    finally:
        if child.poll() is None:
            child.kill()
    assert counts(backend.url) == (0, 0)  # nothing reached the store before the kill
    again = replica(backend.url, spill=spill)
    assert again.store.flush(120)
    again.close()
    assert counts(backend.url) == (60, 10)
    rep = ab_report.report(backend.url)
    assert rep["store"]["dropped"] == 0 and rep["store"]["unaccounted"] == 0, rep["store"]
    rows = open_store(backend.url, migrate=False).replicas()
    assert [r["status"] for r in rows if r["replica"].endswith(f":{child.pid}")] == ["recovered"]
    assert list(spill.iterdir()) == []


# --- start-up errors and credentials --------------------------------------------------------------


def test_unusable_store_urls_stop_the_start_in_words(tmp_path: Path) -> None:
    """A bad scheme, an unreachable host, an unwritable SQLite path: ``serve`` exits 2 before
    any engine starts, naming --ab-store and why in one line, with no traceback and no password."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    secret = "hunter2-not-logged"
    closed = free_port()  # nothing listens there
    for url, why in (
        ("mysql://db.example/ab", "is not a store URL this server knows"),
        (f"postgresql://steer:{secret}@127.0.0.1:{closed}/ab", "Connection refused"),
        (f"sqlite:///{blocker}/ab.db", "cannot"),
    ):
        out = CliRunner().invoke(app, ["serve", "--ab-store", url], env={"COLUMNS": "400"})
        text = said(out.output)
        assert out.exit_code == 2 and "--ab-store" in text and why in text, out.output
        assert secret not in out.output and "Traceback" not in out.output
    out = CliRunner().invoke(  # the report: the same words, exit 2
        app, ["ab-report", f"postgresql://steer:{secret}@127.0.0.1:{closed}/ab"]
    )
    assert out.exit_code == 2 and "Connection refused" in said(out.output), out.output
    assert secret not in out.output
    # as a user sees it: the real process, its stderr whole
    env = os.environ | {
        "STEERSERVE_AB_STORE": f"postgresql://steer:{secret}@127.0.0.1:{closed}/x",
        "COLUMNS": "400",
    }
    r = subprocess.run(
        [sys.executable, "-m", "steerserve", "serve"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr and secret not in r.stderr, r.stderr
    assert "--ab-store" in r.stderr and "postgresql://steer:***@127.0.0.1" in r.stderr, r.stderr


def test_postgres_credentials_from_libpq_variables(
    pg: Postgres, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A URL without a password takes it from PGPASSWORD (as from ~/.pgpass or a mounted
    PGPASSFILE); a wrong one is refused without being repeated."""
    url = pg.url(password=False)
    monkeypatch.setenv("PGPASSWORD", "wrong-password-x")
    with pytest.raises(ValueError, match="password authentication failed") as e:
        open_store(url)
    assert "wrong-password-x" not in str(e.value)
    monkeypatch.setenv("PGPASSWORD", pg.url().split(":")[2].split("@")[0])
    with open_store(url) as store:
        assert store.version() == len(schema.MIGRATIONS)
    assert shown(pg.url()) == pg.url().replace("s3cret-pw", "***")


# --- two server processes on one store (the acceptance case) ---------------------------------------


USERS = [f"user-{i}" for i in range(20)]


@pytest.mark.parametrize("kind", BACKENDS)
def test_two_servers_share_one_store(
    kind: str, tiny_llama: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Two ``steerserve serve`` processes on one store: 20 users get the same arm on both; 20
    feedbacks, each posted to the replica that did not answer, are answered 200 and joined;
    ``ab-report STORE`` counts 40 decisions and 20 scores and equals the report of both
    replicas' JSONL exports together; each replica's /experiments shows both replicas' records."""
    from _postgres import bindir
    from _process import HEADERS, Serve

    if kind == "sqlite" and (bins := bindir()) is not None and (bins / "pg_ctl").exists():
        pytest.skip(  # two real servers cost ~45 s a run: one run where PostgreSQL runs
            "the PostgreSQL run is the two serve processes' case; SQLite shared by processes: "
            "test_feedback_cap_holds_across_processes[sqlite] and the replica tests"
        )
    if kind == "sqlite":
        url = f"sqlite:///{tmp_path}/ab.db"
    else:
        url = request.getfixturevalue("pg").database("two_servers")
    servers = []
    for i in range(2):
        srv = Serve(tiny_llama, tmp_path)
        srv.env |= {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # one process per server: lighter
            "STEERSERVE_AB_SPLIT": "0.5",
            "STEERSERVE_AB_NAME": "replicas",
            "STEERSERVE_AB_STORE": url,
            "STEERSERVE_AB_LOG": str(tmp_path / f"replica-{i}.jsonl"),
        }
        servers.append(srv)
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda s: s.start(), servers))
        a, b = (httpx.Client(base_url=s.url, headers=HEADERS, timeout=300) for s in servers)
        exp = Experiment("replicas", 0.5)
        for user in USERS:
            body = {"model": "tiny", "messages": [{"role": "user", "content": "Quelle est la"}]}
            body |= {"max_tokens": 1, "user": user}
            ra, rb = (
                a.post("/v1/chat/completions", json=body),
                b.post("/v1/chat/completions", json=body),
            )
            assert ra.status_code == rb.status_code == 200, (ra.text, rb.text)
            arm = ra.json()["steering"]["experiment"]["arm"]
            assert arm == rb.json()["steering"]["experiment"]["arm"] == exp.assign(user).arm
            fb = b.post("/v1/steering/feedback", json={"id": ra.json()["id"], "score": 1})
            assert fb.status_code == 200 and fb.json()["arm"] == arm, fb.text
        for c in (a, b):  # a real signal: each replica says its queue is written
            while (snap := c.get("/v1/steering/experiments").json())["store"]["queued"]:
                time.sleep(0.1)
        assert snap["report"]["requests"] == 40  # every replica's, on either one's page
    finally:
        for s in servers:
            s.stop()
    out = CliRunner().invoke(app, ["ab-report", url, "--out", str(tmp_path / "report")])
    assert out.exit_code == 0, out.output
    rep = json.loads((tmp_path / "report" / "report.json").read_text())
    arms = rep["experiments"]["replicas"]["overall"]["arms"]
    assert rep["requests"] == 40
    assert arms["steered"]["score"]["n"] + arms["unsteered"]["score"]["n"] == 20
    together = tmp_path / "all.jsonl"
    together.write_text("".join((tmp_path / f"replica-{i}.jsonl").read_text() for i in range(2)))
    rep.pop("store")
    assert rep == json.loads(ab_report.render(ab_report.report(together), "json"))
