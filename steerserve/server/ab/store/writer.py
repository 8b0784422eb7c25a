"""Records to the experiment store off the request path: a bounded queue plus a write-ahead file,
one writer thread, and every drop counted."""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

from steerserve.server.ab.experiment import StoreUnavailable
from steerserve.server.ab.store import wal
from steerserve.server.ab.store.base import HEARTBEAT_SECONDS, STOPPED, Replica, Store, StoreError

if TYPE_CHECKING:
    from steerserve.server.metrics import Metrics

logger = logging.getLogger(__name__)

#: Records held while the store is unreachable (about 1 KB each without content): past this the
#: newest is dropped and counted.
MAX_QUEUED = 100_000
BATCH = 500  # records per transaction
#: How long the writer lets records gather before a transaction: one write (and one wake-up of
#: its thread, which competes with the event loop for the GIL) for all the requests answered
#: meanwhile, instead of one per request. Records reach the store this much later.
LINGER_SECONDS = 0.1
BACKOFF = (0.05, 2.0)  # seconds between retries: first, most
#: How long a feedback for an id the store does not know yet waits for it: the replica that
#: answered may still be writing its decision (its writer runs a few milliseconds behind).
FEEDBACK_GRACE_SECONDS = 1.0
DRAIN_SECONDS = 5.0  # at shutdown, how long the queue may drain before the rest is spilled
SPILL_PREFIX = "ab-spill-"
#: Seconds between the writer's flushes of the write-ahead file to the disk (a machine's crash,
#: not a process's, loses at most the decisions appended since; feedback waits for its flush).
WAL_SYNC_SECONDS = 1.0


_writers = itertools.count(1)


def replica_name() -> str:
    """This writer among the replicas: host and pid (and a number after the first writer of a
    process, as in tests that run two replicas in one)."""
    n = next(_writers)
    return f"{socket.gethostname()}:{os.getpid()}" + (f"/{n}" if n > 1 else "")


class Writer:
    """The store's writer thread and its queue; also the feedback path straight to the store.

    ``on_lost(rid)`` is told of a decision that never reached the store (its feedback can never
    be joined)."""

    def __init__(
        self,
        store: Store,
        spill_dir: Path | None,
        metrics: Metrics | None = None,
        max_queued: int = MAX_QUEUED,
        on_lost: Callable[[str], None] | None = None,
    ) -> None:
        self.store = store
        self.spill_dir = spill_dir
        self.metrics = metrics
        self.max_queued = max_queued
        self.on_lost = on_lost
        self.replica = Replica(replica_name(), time.time())
        self.written = 0
        self.dropped = 0
        self.up = True
        self._queue: deque[dict[str, Any]] = deque()
        self._pending: Counter[str] = Counter()  # id -> its records still queued
        self._done = 0  # records taken off the queue: written, refused or dropped
        self._enqueued = 0  # records ever queued (the index a write-ahead segment ends at)
        self._replays: list[tuple[wal.Claimed, int]] = []  # a claimed file, done once _done >= n
        self._cond = threading.Condition()
        self._closing = False
        self._stop = False
        self._warned_drop = False
        self._new_drops = 0  # dropped since the writer last took them for the store's row
        self._reported = 0.0  # when the replica's row was last written
        self._synced = 0.0  # when the write-ahead file was last flushed to the disk
        self._set_up(True)
        self._load_spills()
        self.wal = None if spill_dir is None else wal.Wal(spill_dir, self._key(), self.replica.name)
        self._thread = threading.Thread(target=self._run, name="ab-store-writer", daemon=True)
        self._thread.start()

    # --- the request side ---------------------------------------------------------------------

    def put(self, rec: dict[str, Any], sync: bool = False) -> bool:
        """Queue one record and append it to the write-ahead file (one write(2) under the lock,
        no wait for the disk unless ``sync``: then it is on the disk when this returns); False
        when it was dropped."""
        with self._cond:
            if self._closing or len(self._queue) >= self.max_queued:
                self._count_drop(1, "the queue is full" if not self._closing else "closing")
                return False
            self._queue.append(rec)
            self._enqueued += 1
            if self.wal is not None:
                self.wal.append(rec, self._enqueued)
                if sync:
                    self.wal.sync()
            self._pending[str(rec["id"])] += 1
            self._gauge()
            if len(self._queue) in (1, BATCH):  # the writer waits for the first, or a batch
                self._cond.notify_all()
        return True

    def holds(self, rid: str) -> bool:
        """Whether a record of ``rid`` still waits here (its feedback must queue behind it)."""
        with self._cond:
            return self._pending[rid] > 0

    def feedback(self, rec: dict[str, Any]) -> dict[str, Any]:
        """One score straight into the store, the cap counted there across replicas: the
        decision's (experiment, arm, language). ``KeyError``: no such decision in the store (yet:
        the caller may ask again, see :data:`FEEDBACK_GRACE_SECONDS`); :class:`FeedbackLimit`;
        :class:`StoreUnavailable`."""
        retried = False
        while True:
            try:
                known = self.store.feedback(rec, self.replica)
            except StoreUnavailable:
                if retried:
                    raise
                retried = True  # a pooled connection the server closed: once more, a new one
                continue
            except StoreError as e:  # a bad record: nothing a retry changes
                raise StoreUnavailable(str(e)) from None
            with self._cond:
                self.written += 1
            if self.metrics is not None:
                self.metrics.ab_store_written.inc()
            return known

    @property
    def queued(self) -> int:
        with self._cond:
            return len(self._queue)

    def flush(self, timeout: float) -> bool:
        """Wait until the queue is empty (True) or ``timeout`` passed (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue, timeout)

    def backlog(self) -> list[str]:
        """The other replicas that may still hold records the store lacks (``Store.backlog``)."""
        return self.store.backlog(self.replica.name)

    def close(self, timeout: float = DRAIN_SECONDS) -> None:
        """Drain the queue for up to ``timeout`` seconds, then keep the rest in a spill file
        (where that fails, the write-ahead file keeps them) and close the store."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(1.0)
        with self._cond:
            rest = list(self._queue)
            self._queue.clear()
            self._pending.clear()
            self._gauge()
        kept = self._spill(rest) if rest else True
        if self.wal is not None:
            self.wal.close(delete=kept)
        if kept:
            for claimed, _ in self._replays:
                wal.done(claimed)
            self._replays = []
        if not rest:
            self._stopped()
        self.store.close()

    def _stopped(self) -> None:
        """Say in the replica's row that this process stopped with nothing queued (it then
        counts in no replica's backlog)."""
        self.replica.status, self.replica.queued = STOPPED, 0
        try:
            self._report()
        except (StoreUnavailable, StoreError):
            pass  # the store is gone: its row goes stale, which the backlog check allows for

    # --- the writer thread --------------------------------------------------------------------

    def _run(self) -> None:
        backoff = BACKOFF[0]
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    if not self._cond.wait(min(HEARTBEAT_SECONDS, WAL_SYNC_SECONDS)):
                        self._idle()
                if not self._closing and len(self._queue) < BATCH:
                    self._cond.wait(LINGER_SECONDS)  # let a batch gather (ends early when full)
                if self._stop or not self._queue:
                    return
                batch = list(islice(self._queue, BATCH))
                self.replica.queued = len(self._queue) - len(batch)
                self.replica.drops += self._new_drops  # the writer thread's alone from here
                self._new_drops = 0
            try:
                refused = self._write(batch)
            except StoreUnavailable as e:
                self._set_up(False, str(e))
                with self._cond:
                    if self._cond.wait_for(lambda: self._stop, backoff):
                        return
                backoff = min(backoff * 2, BACKOFF[1])
                continue
            backoff = BACKOFF[0]
            self._set_up(True)
            self._taken(batch, *refused)

    def _idle(self) -> None:
        """Called under the lock while nothing is queued: the write-ahead file to the disk, and
        the replica's row refreshed now and then (so other replicas know it is alive)."""
        if self.wal is not None:
            self.wal.sync()
            self._synced = time.monotonic()
        if time.monotonic() - self._reported >= HEARTBEAT_SECONDS:
            self.replica.queued = 0
            try:
                self._report()
                self._set_up(True)
            except StoreUnavailable as e:
                self._set_up(False, str(e))
            except StoreError:
                pass

    def _report(self) -> None:
        """The replica's row alone (a heartbeat)."""
        with self.store._tx() as cur:
            self.replica.report(cur, 0, self.replica.drops)
        self.replica.drops = 0
        self._reported = time.monotonic()

    def _write(self, batch: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
        """The batch in one transaction; when the store refuses it (a bad record), each record
        alone, so one bad record costs only itself. (Refused records, records new to the
        store.)"""
        if self.wal is not None and time.monotonic() - self._synced >= WAL_SYNC_SECONDS:
            self.wal.sync()  # busy, never idle: still to the disk every second
            self._synced = time.monotonic()
        try:
            refused, new = self.store.write(batch, self.replica)
            self.replica.drops = 0  # in the store's row now
            self._reported = time.monotonic()
            return refused, new
        except StoreError as e:
            logger.error("experiment store refused a batch (%s); writing its records one by one", e)
        refused, new = [], 0
        for rec in batch:
            try:
                got, n = self.store.write([rec], self.replica)
                refused += got
                new += n
                self.replica.drops = 0
            except StoreError as e:
                logger.error("experiment store refused record %s: %s", rec.get("id"), e)
                self.replica.drops += 1
                refused.append(rec)
        return refused, new

    def _taken(
        self, batch: list[dict[str, Any]], refused: list[dict[str, Any]], new: int = 0
    ) -> None:
        """``batch`` is off the queue: written, or refused by the store (counted as dropped)."""
        with self._cond:
            for _ in batch:
                if not self._queue:  # closed meanwhile: the rest went to a spill file
                    break
                rec = self._queue.popleft()
                rid = str(rec["id"])
                self._pending[rid] -= 1
                if self._pending[rid] <= 0:
                    del self._pending[rid]
            self._done += len(batch)
            self.written += new
            self.dropped += len(refused)
            finished = self._unlink_replayed()
            if self.wal is not None:
                self.wal.release(self._done)
            self._gauge()
            self._cond.notify_all()
        for name in finished:  # a dead replica's queue is in the store now: its row says so
            try:
                self.store.recovered(name)
            except (StoreUnavailable, StoreError):
                pass
        if self.metrics is not None:
            self.metrics.ab_store_written.inc(new)
            self.metrics.ab_store_dropped.inc(len(refused))
        for rec in refused:
            logger.warning(
                "experiment store: %s for %s dropped (over the cap or no such decision)",
                rec.get("type"),
                rec.get("id"),
            )
            if rec.get("type") == "decision" and self.on_lost is not None:
                self.on_lost(str(rec["id"]))

    # --- bookkeeping --------------------------------------------------------------------------

    def _count_drop(self, n: int, why: str) -> None:
        """Called under the lock: ``n`` records that will never be in the store."""
        self.dropped += n
        self._new_drops += n
        if self.metrics is not None:
            self.metrics.ab_store_dropped.inc(n)
        if not self._warned_drop:
            self._warned_drop = True
            logger.error(
                "experiment store %s: dropping records (%s, %d queued); counting them in "
                "steerserve_ab_store_dropped_total",
                self.store.shown,
                why,
                len(self._queue),
            )

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.ab_store_queued.set(len(self._queue))

    def _set_up(self, up: bool, why: str = "") -> None:
        if self.metrics is not None:
            self.metrics.ab_store_up.set(int(up))
        if up == self.up:
            return
        self.up = up
        if up:
            self._warned_drop = False
            logger.info("experiment store %s reachable again; writing the queue", self.store.shown)
        else:
            logger.warning(
                "experiment store unreachable (%s): records queue here (at most %d) and are "
                "retried in order",
                why,
                self.max_queued,
            )

    # --- spill files: the queue across a restart ----------------------------------------------

    def _key(self) -> str:
        return hashlib.sha256(self.store.shown.encode()).hexdigest()[:12]

    def _spill_name(self) -> str:
        return f"{SPILL_PREFIX}{self._key()}-"

    def _spill(self, records: list[dict[str, Any]]) -> bool:
        """Keep ``records`` (not yet in the store) for the next start; False when that failed
        (the write-ahead file still holds them; with none they are counted as dropped)."""
        if self.spill_dir is None:
            with self._cond:
                self._count_drop(len(records), "no spill folder at shutdown")
            return True
        name = f"{self._spill_name()}{socket.gethostname()}-{os.getpid()}-{time.time_ns()}.jsonl"
        path = self.spill_dir / name
        try:
            self.spill_dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(json.dumps({"type": "spill", "replica": self.replica.name}) + "\n")
                for rec in records:
                    f.write(json.dumps(rec, ensure_ascii=True) + "\n")
                f.flush()
                os.fsync(f.fileno())
            tmp.rename(path)
        except OSError as e:
            logger.error(
                "experiment store: cannot keep %d queued records in a spill file (%s); the "
                "write-ahead file in %s keeps them",
                len(records),
                e,
                self.spill_dir,
            )
            return False
        logger.warning(
            "experiment store %s unreachable at shutdown: %d records kept in %s, written at the "
            "next start",
            self.store.shown,
            len(records),
            path,
        )
        return True

    def _load_spills(self) -> None:
        """Claim the files of this store that no live process holds (spill files of a clean
        stop, the write-ahead files of a process that died) and queue their records first; a
        file is deleted once its records are written. A line a crash tore is counted as
        dropped (in this replica's row: the report says so)."""
        prefixes = (self._spill_name(), f"{wal.WAL_PREFIX}{self._key()}-")
        loaded = 0
        for claimed in wal.claim(self.spill_dir, prefixes):
            if claimed.unreadable:
                self._count_drop(claimed.unreadable, "unreadable lines in a file left by a crash")
            for rec in claimed.records:
                self._queue.append(rec)
                self._pending[str(rec.get("id"))] += 1
                loaded += 1
            self._enqueued = len(self._queue)
            self._replays.append((claimed, len(self._queue)))
        if loaded:
            logger.info(
                "experiment store: %d records a stopped or killed process left queued", loaded
            )
            self._gauge()

    def _unlink_replayed(self) -> list[str]:
        """Delete the claimed files whose records are all written; the replicas they came from
        (their rows then say recovered)."""
        names = []
        while self._replays and self._done >= self._replays[0][1]:
            claimed, _ = self._replays.pop(0)
            wal.done(claimed)
            if claimed.replica and claimed.replica != self.replica.name:
                names.append(claimed.replica)
        return names
