"""Records to the experiment store off the request path: a request only appends to a bounded
in-memory queue (no I/O); one thread writes the queue in order, in batches, and retries while
the store is unreachable. What cannot wait is counted, never silent: a full queue drops the new
record (``steerserve_ab_store_dropped_total``, logged once per outage). At shutdown the queue is
drained for a bounded time and what is left is kept in a spill file, written at the next start.
"""

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

from steerserve.server.ab.experiment import MAX_FEEDBACK_PER_ID, StoreUnavailable
from steerserve.server.ab.store.base import Replica, Store, StoreError

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
        self._replays: list[tuple[Path, int]] = []  # a claimed spill file, done once _done >= n
        self._cond = threading.Condition()
        self._closing = False
        self._stop = False
        self._warned_drop = False
        self._new_drops = 0  # dropped since the writer last took them for the store's row
        self._set_up(True)
        self._load_spills()
        self._thread = threading.Thread(target=self._run, name="ab-store-writer", daemon=True)
        self._thread.start()

    # --- the request side ---------------------------------------------------------------------

    def put(self, rec: dict[str, Any]) -> bool:
        """Queue one record (a dict append under a lock: no I/O); False when it was dropped."""
        with self._cond:
            if self._closing or len(self._queue) >= self.max_queued:
                self._count_drop(1, "the queue is full" if not self._closing else "closing")
                return False
            self._queue.append(rec)
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
                known = self.store.feedback(rec, self.replica, MAX_FEEDBACK_PER_ID)
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

    def close(self, timeout: float = DRAIN_SECONDS) -> None:
        """Drain the queue for up to ``timeout`` seconds, then keep the rest in a spill file
        (counted as dropped where it cannot be written) and close the store."""
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
        if rest:
            self._spill(rest)
        self.store.close()

    # --- the writer thread --------------------------------------------------------------------

    def _run(self) -> None:
        backoff = BACKOFF[0]
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
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
            self._taken(batch, refused)

    def _write(self, batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The batch in one transaction; when the store refuses it (a bad record), each record
        alone, so one bad record costs only itself."""
        try:
            refused = self.store.write(batch, self.replica, MAX_FEEDBACK_PER_ID)
            self.replica.drops = 0  # in the store's row now
            return refused
        except StoreError as e:
            logger.error("experiment store refused a batch (%s); writing its records one by one", e)
        refused = []
        for rec in batch:
            try:
                refused += self.store.write([rec], self.replica, MAX_FEEDBACK_PER_ID)
                self.replica.drops = 0
            except StoreError as e:
                logger.error("experiment store refused record %s: %s", rec.get("id"), e)
                self.replica.drops += 1
                refused.append(rec)
        return refused

    def _taken(self, batch: list[dict[str, Any]], refused: list[dict[str, Any]]) -> None:
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
            self.written += len(batch) - len(refused)
            self.dropped += len(refused)
            self._unlink_replayed()
            self._gauge()
            self._cond.notify_all()
        if self.metrics is not None:
            self.metrics.ab_store_written.inc(len(batch) - len(refused))
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

    def _spill_name(self) -> str:
        key = hashlib.sha256(self.store.shown.encode()).hexdigest()[:12]
        return f"{SPILL_PREFIX}{key}-"

    def _spill(self, records: list[dict[str, Any]]) -> None:
        """Keep ``records`` (not yet in the store) for the next start, or count them dropped."""
        if self.spill_dir is None:
            with self._cond:
                self._count_drop(len(records), "no spill folder at shutdown")
            return
        name = f"{self._spill_name()}{socket.gethostname()}-{os.getpid()}-{time.time_ns()}.jsonl"
        path = self.spill_dir / name
        try:
            self.spill_dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            with open(tmp, "w", encoding="utf-8") as f:
                for rec in records:
                    f.write(json.dumps(rec, ensure_ascii=True) + "\n")
                f.flush()
                os.fsync(f.fileno())
            tmp.rename(path)
        except OSError as e:
            logger.error("experiment store: cannot keep %d queued records: %s", len(records), e)
            with self._cond:
                self._count_drop(len(records), f"the spill file failed: {e}")
            return
        logger.warning(
            "experiment store %s unreachable at shutdown: %d records kept in %s, written at the "
            "next start",
            self.store.shown,
            len(records),
            path,
        )

    def _load_spills(self) -> None:
        """Claim the spill files of this store (a rename: two processes never take the same
        one, and one whose claimer died on this host is taken again) and queue their records
        first; a file is deleted once its records are written."""
        if self.spill_dir is None or not self.spill_dir.is_dir():
            return
        host, loaded = socket.gethostname(), 0
        for path in sorted(self.spill_dir.glob(f"{self._spill_name()}*")):
            if not _claimable(path, host):
                continue
            base = path.name.split(".jsonl")[0] + ".jsonl"
            claimed = path.with_name(f"{base}.replaying-{host}-{os.getpid()}")
            try:
                path.rename(claimed)
                lines = claimed.read_text(encoding="utf-8").splitlines()
            except OSError:
                continue  # another process claimed it first
            for line in lines:
                try:
                    rec = json.loads(line)
                except ValueError:
                    self._count_drop(1, "an unreadable line in a spill file")
                    continue
                self._queue.append(rec)
                self._pending[str(rec.get("id"))] += 1
                loaded += 1
            self._replays.append((claimed, len(self._queue)))
        if loaded:
            logger.info("experiment store: %d records kept at the last stop queued", loaded)
            self._gauge()

    def _unlink_replayed(self) -> None:
        while self._replays and self._done >= self._replays[0][1]:
            path, _ = self._replays.pop(0)
            path.unlink(missing_ok=True)


def _claimable(path: Path, host: str) -> bool:
    """A finished spill file, or one claimed by a process of this host that is gone."""
    name = path.name
    if name.endswith(".jsonl"):
        return True
    marker = f".replaying-{host}-"
    if marker not in name:
        return False
    try:
        os.kill(int(name.rsplit("-", 1)[1]), 0)
    except ProcessLookupError:
        return True
    except (ValueError, PermissionError):
        return False
    return False
