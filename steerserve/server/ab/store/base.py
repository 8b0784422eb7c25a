"""The experiment store's SQL, shared by both backends: migrating the schema (``schema.py``),
decisions and feedback written as rows, the per-id feedback cap checked inside the database, and
the reads a report needs. A backend (``sqlite.py``, ``postgres.py``) only connects, opens a
transaction and says which of its errors mean "unreachable, try again".
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from steerserve.server.ab.experiment import (
    FeedbackLimit,
    StoreUnavailable,
    WrongKind,
    cap_for,
    check_kind,
)
from steerserve.server.ab.metrics import FEEDBACK as HUMAN
from steerserve.server.ab.store import schema
from steerserve.server.ab.store.schema import (
    COLUMNS,
    COMPONENT,
    DECISIONS,
    EXPERIMENTS,
    FEEDBACK,
    PHASES,
    REPLICAS,
    VERSIONS,
)

logger = logging.getLogger(__name__)

#: Connections kept open for reuse (request threads and the writer take one each).
POOL = 4
#: Seconds between a writer's reports of itself (its queue) when it has nothing to write.
HEARTBEAT_SECONDS = 2.0
#: A replica that has not reported for this long is silent (perhaps cut off from the store,
#: its records queued); past :data:`STALE_SECONDS` it is taken for gone (its queue, if it had
#: one, is counted as unaccounted for in the report).
SILENT_SECONDS = 3 * HEARTBEAT_SECONDS
STALE_SECONDS = 60.0
RUNNING, STOPPED, RECOVERED = "running", "stopped", "recovered"


class StoreError(Exception):
    """The store refused a statement for a reason a retry will not mend (a bad value, a schema
    from a newer steerserve, a wrong URL)."""


class Store:
    """One experiment store (a backend subclasses it). Thread-safe: each call takes a pooled
    connection; one that failed is closed, never reused."""

    scheme = ""
    serial = ""  # the auto-increment key type of the backend's SQL
    for_update = ""  # how a SELECT locks the rows it reads until the transaction ends

    def __init__(self, url: str, shown: str) -> None:
        self.url = url  # may hold a password: never logged, never in a message
        self.shown = shown  # the URL as it may be shown (password masked)
        self._idle: list[Any] = []
        self._lock = threading.Lock()

    # --- what a backend provides --------------------------------------------------------------

    def _connect(self) -> Any:
        raise NotImplementedError

    def _begin(self, conn: Any) -> None:
        raise NotImplementedError

    def _lock_schema(self, cur: Any) -> None:
        """Serialise migrations of several replicas starting at once (inside the transaction)."""

    def _transient(self, e: BaseException) -> bool:
        """Whether ``e`` means the database is unreachable or busy (a retry may succeed)."""
        raise NotImplementedError

    def _is_db_error(self, e: BaseException) -> bool:
        raise NotImplementedError

    def _sql(self, sql: str) -> str:
        return sql

    # --- connections and transactions ---------------------------------------------------------

    def _acquire(self) -> Any:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return self._connect()

    def _release(self, conn: Any, ok: bool) -> None:
        if ok:
            with self._lock:
                if len(self._idle) < POOL:
                    self._idle.append(conn)
                    return
        _close(conn)

    def _drop_idle(self) -> None:
        """After a connection failed, the idle ones are likely dead too (a restarted server)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            _close(conn)

    @contextmanager
    def _tx(self) -> Iterator[Any]:
        """A cursor inside one transaction: committed when the block ends, rolled back when it
        raises. A database error becomes :class:`StoreUnavailable` (transient) or
        :class:`StoreError`; the experiment's own exceptions pass through."""
        conn = self._acquire()
        ok = False
        try:
            cur = conn.cursor()
            self._begin(conn)
            try:
                yield _Cursor(cur, self._sql)
            except BaseException:
                _rollback(conn)
                raise
            conn.commit()
            ok = True
        except (KeyError, FeedbackLimit, WrongKind, LookupError, ValueError):
            ok = True  # refused, not broken: the connection is fine (rolled back above)
            raise
        except Exception as e:
            if not self._is_db_error(e):
                raise
            if self._transient(e):
                self._drop_idle()
                raise StoreUnavailable(f"{self.shown}: {self._scrub(e)}") from None
            raise StoreError(f"{self.shown}: {self._scrub(e)}") from None
        finally:
            self._release(conn, ok)

    def _scrub(self, e: BaseException) -> str:
        """An error's text, first line, with any password of the URL masked."""
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        from urllib.parse import urlsplit

        secret = urlsplit(self.url).password
        return text.replace(secret, "***") if secret else text

    def close(self) -> None:
        self._drop_idle()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- schema -------------------------------------------------------------------------------

    def migrate(self) -> tuple[int, int]:
        """Bring the schema to this steerserve's version (several replicas may start at once:
        one migrates, the others find it done); (version found, version now). A schema newer
        than this steerserve knows is refused (an older server must not write to it)."""
        with self._tx() as cur:
            self._lock_schema(cur)
            cur.execute(
                f"CREATE TABLE IF NOT EXISTS {VERSIONS} "
                "(component TEXT PRIMARY KEY, version INTEGER NOT NULL)"
            )
            found = self._version(cur)
            if found > len(schema.MIGRATIONS):
                raise StoreError(
                    f"{self.shown}: its schema is version {found}, newer than this steerserve's "
                    f"{len(schema.MIGRATIONS)}: upgrade steerserve"
                )
            for version in range(found + 1, len(schema.MIGRATIONS) + 1):
                for stmt in schema.MIGRATIONS[version - 1]:
                    cur.execute(stmt.format(serial=self.serial))
                logger.info("experiment store %s: schema version %d", self.shown, version)
            cur.execute(
                f"INSERT INTO {VERSIONS} (component, version) VALUES (?, ?) ON CONFLICT "
                f"(component) DO UPDATE SET version = excluded.version",
                (COMPONENT, len(schema.MIGRATIONS)),
            )
        return found, len(schema.MIGRATIONS)

    def version(self) -> int:
        """The schema's version (0: no steerserve store here yet)."""
        with self._tx() as cur:
            if not self._has_table(cur, VERSIONS):
                return 0
            return self._version(cur)

    def _has_table(self, cur: _Cursor, name: str) -> bool:
        raise NotImplementedError

    @staticmethod
    def _version(cur: _Cursor) -> int:
        cur.execute(f"SELECT version FROM {VERSIONS} WHERE component = ?", (COMPONENT,))
        row = cur.fetchone()
        return 0 if row is None else int(row[0])

    # --- writes -------------------------------------------------------------------------------

    def write(
        self, records: Sequence[dict[str, Any]], replica: Replica
    ) -> tuple[list[dict[str, Any]], int]:
        """Decisions and feedback in one transaction, in order; a record written before (a
        retry after a lost answer, a replayed spill or write-ahead file) is not written twice.
        Feedback over its cap, for an unknown id or of the wrong kind is refused: those records
        are returned (and counted as dropped in the replica's row, written in the same
        transaction) with how many records were new to the store."""
        refused, new = [], 0
        with self._tx() as cur:
            for rec in records:
                if rec.get("type") == "feedback":
                    try:
                        new += self._feedback(cur, rec, replica.name)[1]
                    except (KeyError, FeedbackLimit, WrongKind):
                        refused.append(rec)
                else:
                    new += self._decision(cur, rec, replica.name)
            replica.report(cur, new, replica.drops + len(refused))
        return refused, new

    def feedback(self, rec: dict[str, Any], replica: Replica) -> dict[str, Any]:
        """One score, now: the decision's (experiment, arm, language). ``KeyError``: no such
        decision in the store; :class:`FeedbackLimit`: its cap reached already, from any
        replica; :class:`WrongKind`: a preference for an answer that is not a pair, or a score
        for a pair."""
        with self._tx() as cur:
            known, new = self._feedback(cur, rec, replica.name)
            replica.report(cur, int(new), 0)
        return known

    def _decision(self, cur: _Cursor, rec: dict[str, Any], replica: str) -> int:
        """Insert one decision; 1 when it is new, 0 when the store had it (a replayed record)."""
        values = [schema.column(k, rec.get(k)) for k in COLUMNS]
        extra = {k: v for k, v in rec.items() if k not in COLUMNS and k not in ("type", "id")}
        cols = ", ".join(COLUMNS)
        marks = ", ".join("?" * (len(COLUMNS) + 3))
        cur.execute(
            f"INSERT INTO {DECISIONS} (id, {cols}, extra, replica) VALUES ({marks}) "
            "ON CONFLICT (id) DO NOTHING",
            (str(rec["id"]), *values, schema.to_json(extra) if extra else None, replica),
        )
        return 1 if cur.rowcount == 1 else 0

    def _feedback(
        self, cur: _Cursor, rec: dict[str, Any], replica: str
    ) -> tuple[dict[str, Any], bool]:
        """One feedback row, counted against its decision's cap: (the decision's experiment,
        arm and language, whether it was new). The decision's row is read and locked by one
        statement (``for_update``) before anything is decided: under PostgreSQL's READ
        COMMITTED each statement sees what was committed before it, so deciding from two
        statements (an UPDATE that found no row, then a SELECT that found it, committed in
        between by another replica) called a first score over the cap."""
        rid, metric = str(rec["id"]), rec.get("metric") or HUMAN
        cur.execute(
            f"SELECT experiment, arm, language, feedback_count FROM {DECISIONS} WHERE id = ?"
            + self.for_update,
            (rid,),
        )
        row = cur.fetchone()
        if row is None:
            raise KeyError(rid)
        cur.execute(f"SELECT 1 FROM {FEEDBACK} WHERE fid = ?", (rec["fid"],))
        if cur.fetchone() is not None:  # this very score is in already (a retried write)
            return schema.known(row), False
        check_kind(rid, row[1], metric)
        if int(row[3]) >= cap_for(metric):
            raise FeedbackLimit(rid)
        cur.execute(
            f"UPDATE {DECISIONS} SET feedback_count = feedback_count + 1 WHERE id = ?", (rid,)
        )
        cur.execute(
            f"INSERT INTO {FEEDBACK} (fid, id, ts, score, replica, metric) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (rec["fid"], rid, float(rec["ts"]), float(rec["score"]), replica, rec.get("metric")),
        )
        return schema.known(row), True

    # --- reads --------------------------------------------------------------------------------

    def records(self) -> Iterator[dict[str, Any]]:
        """The experiments and their phases, every decision, then every feedback in the order
        the store took them: the records a JSONL decision log of all the replicas would hold
        (``ab_report`` joins them). A store of an older schema reads as it was written."""
        with self._tx() as cur:
            version = self._version(cur)
            cols = [k if schema.SINCE.get(k, 0) <= version else "NULL" for k in COLUMNS]
            cur.execute(f"SELECT id, {', '.join(cols)}, extra FROM {DECISIONS} ORDER BY ts, id")
            decisions = cur.fetchall()
            cur.execute(f"SELECT id, ts, score, metric FROM {FEEDBACK} ORDER BY seq")
            feedback = cur.fetchall()
            registry = read_registry(cur) if version >= 3 else []
        yield from registry
        for row in decisions:
            yield schema.record(row)
        for rid, ts, score, metric in feedback:
            rec = {"type": "feedback", "ts": ts, "id": rid, "score": score}
            yield rec if metric is None else rec | {"metric": metric}

    def recent(self, n: int) -> list[dict[str, Any]]:
        """The latest ``n`` decisions that kept their reply (--ab-log-content), newest first,
        each with its last score."""
        with self._tx() as cur:
            cur.execute(
                f"SELECT d.id, d.ts, d.experiment, d.arm, d.language, d.prompt, d.reply, "
                f"(SELECT f.score FROM {FEEDBACK} f WHERE f.id = d.id AND f.metric IS NULL "
                f"ORDER BY f.seq DESC LIMIT 1) FROM {DECISIONS} d WHERE d.reply IS NOT NULL "
                "ORDER BY d.ts DESC LIMIT ?",
                (n,),
            )
            rows = cur.fetchall()
        keys = ("id", "ts", "experiment", "arm", "language", "prompt", "reply", "score")
        out = [dict(zip(keys, row, strict=True)) for row in rows]
        for r in out:
            r["prompt"], r["reply"] = schema.from_json(r["prompt"]), schema.from_json(r["reply"])
        return out

    def stamp(self) -> tuple[float, ...]:
        """Changes whenever a record, an experiment's record or a replica's counts do: a
        report cache's key."""
        with self._tx() as cur:
            registry = self._version(cur) >= 3
            cur.execute(
                f"SELECT (SELECT count(*) FROM {DECISIONS}), "
                f"(SELECT coalesce(max(seq), 0) FROM {FEEDBACK}), "
                f"(SELECT coalesce(sum(dropped), 0) FROM {REPLICAS}), "
                f"(SELECT coalesce(sum(queued), 0) FROM {REPLICAS})"
                + (
                    f", (SELECT coalesce(max(updated), 0) FROM {EXPERIMENTS})"
                    f", (SELECT count(*) FROM {PHASES})"
                    if registry
                    else ""
                )
            )
            row = cur.fetchone()
        return tuple(float(x) for x in row)

    def replicas(self) -> list[dict[str, Any]]:
        """Each replica's row: what it said of itself at its last write or heartbeat."""
        with self._tx() as cur:
            has_status = self._version(cur) >= 3
            status = "status" if has_status else "NULL"
            cur.execute(f"SELECT replica, seen, written, queued, dropped, {status} FROM {REPLICAS}")
            rows = cur.fetchall()
        keys = ("replica", "seen", "written", "queued", "dropped", "status")
        return [dict(zip(keys, row, strict=True)) for row in rows]

    def status(self, now: float | None = None) -> dict[str, Any]:
        """What the replicas said of themselves: records written, records queued at their last
        report, records dropped (never in the store), and the records of replicas gone silent
        with a queue (``unaccounted``: lost unless their write-ahead file is replayed)."""
        import time

        now = time.time() if now is None else now
        replicas = self.replicas()
        gone = [
            r
            for r in replicas
            if int(r["queued"]) > 0
            and r["status"] not in (STOPPED, RECOVERED)
            and now - float(r["seen"] or 0) > STALE_SECONDS
        ]
        return {
            "url": self.shown,
            "replicas": len(replicas),
            "written": sum(int(r["written"]) for r in replicas),
            "queued": sum(int(r["queued"]) for r in replicas),
            "dropped": sum(int(r["dropped"]) for r in replicas),
            "unaccounted": sum(int(r["queued"]) for r in gone),
            "unaccounted_replicas": sorted(str(r["replica"]) for r in gone),
        }

    def backlog(self, me: str, now: float | None = None) -> list[str]:
        """The other replicas that may hold records not in the store yet: those reporting a
        queue, and those gone silent lately (cut off from the store, their records queued
        there), but not those stopped or silent for :data:`STALE_SECONDS`."""
        import time

        now = time.time() if now is None else now
        out = []
        for r in self.replicas():
            age = now - float(r["seen"] or 0)
            if r["replica"] == me or r["status"] in (STOPPED, RECOVERED) or age > STALE_SECONDS:
                continue
            if int(r["queued"]) > 0 or age > SILENT_SECONDS:
                out.append(str(r["replica"]))
        return out

    def recovered(self, name: str) -> None:
        """Another process replayed ``name``'s queue (its write-ahead file): it holds none. A
        replica killed before its first write has no row yet: it gets one, so it is listed."""
        import time

        now = time.time()
        with self._tx() as cur:
            cur.execute(
                f"INSERT INTO {REPLICAS} (replica, started, seen, written, queued, dropped, status) "
                "VALUES (?, ?, ?, 0, 0, 0, ?) ON CONFLICT (replica) DO UPDATE SET queued = 0, "
                "status = excluded.status",
                (name, now, now, RECOVERED),
            )


def read_registry(cur: _Cursor) -> list[dict[str, Any]]:
    """Every experiment's status record and phase records, as a decision log holds them."""
    cur.execute(f"SELECT name, status, note, phase, updated FROM {EXPERIMENTS} ORDER BY name")
    out: list[dict[str, Any]] = [
        {"type": "experiment", "experiment": n, "status": s, "note": note, "phase": p, "ts": ts}
        for n, s, note, p, ts in cur.fetchall()
    ]
    cur.execute(
        f"SELECT experiment, phase, arms, control, allocation, started, ended, why FROM {PHASES} "
        "ORDER BY experiment, phase"
    )
    for exp, phase, arms, control, allocation, started, ended, why in cur.fetchall():
        out.append(
            {
                "type": "phase",
                "experiment": exp,
                "phase": int(phase),
                "arms": json.loads(arms),
                "control": control,
                "allocation": json.loads(allocation),
                "started": started,
                "ended": ended,
                "why": why,
            }
        )
    return out


class Replica:
    """This process as the store knows it: its row in the replicas table, updated in the
    transaction of each write (``queued``: records still waiting here after it; ``drops``:
    records dropped here and not yet counted in the row: the writer thread's, cleared by it
    once a write carrying them succeeded)."""

    def __init__(self, name: str, started: float) -> None:
        self.name = name
        self.started = started
        self.queued = 0
        self.drops = 0
        self.status = RUNNING

    def report(self, cur: _Cursor, written: int, dropped: int) -> None:
        """Add ``written`` and ``dropped`` to this replica's row (inside the write's
        transaction), with its queue and status now."""
        import time

        cur.execute(
            f"INSERT INTO {REPLICAS} (replica, started, seen, written, queued, dropped, status) "
            f"VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (replica) DO UPDATE SET "
            f"seen = excluded.seen, written = {REPLICAS}.written + excluded.written, "
            f"queued = excluded.queued, dropped = {REPLICAS}.dropped + excluded.dropped, "
            "status = excluded.status",
            (self.name, self.started, time.time(), written, self.queued, dropped, self.status),
        )


class _Cursor:
    """A DB-API cursor taking ``?`` placeholders whatever the driver's style."""

    def __init__(self, cur: Any, sql: Any) -> None:
        self._cur, self._sql = cur, sql

    def execute(self, sql: str, params: Sequence[Any] = ()) -> None:
        self._cur.execute(self._sql(sql), tuple(params))

    def fetchone(self) -> Any:
        return self._cur.fetchone()

    def fetchall(self) -> list[Any]:
        return list(self._cur.fetchall())

    @property
    def rowcount(self) -> int:
        return int(self._cur.rowcount)


def _rollback(conn: Any) -> None:
    """Roll back; a connection too broken for that is closed by the caller anyway."""
    try:
        conn.rollback()
    except Exception:
        pass


def _close(conn: Any) -> None:
    try:
        conn.close()
    except Exception:  # a dead connection: nothing to release
        pass
