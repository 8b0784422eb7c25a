"""A server-side A/B experiment: a sticky split of subjects (users) into a steered and an unsteered
arm, a JSONL decision log, and feedback joined to it."""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from steerserve.server.ab import metrics as ab_metrics
from steerserve.server.ab.design import (
    RUNNING,
    UNSTEERED,
    Design,
    Phase,
    bucket,
    layouts,
    two_arms,
)
from steerserve.server.ab.design import STEERED as STEERED  # the server imports it from here
from steerserve.server.ab.metrics import FEEDBACK, PREFERENCE
from steerserve.server.answers import ExperimentInfo
from steerserve.server.steering import Auto, Off, On, SteeringSpec

logger = logging.getLogger(__name__)

#: The arm of an answer of the A/B endpoint (``/v1/chat/completions/ab``, ``/compare``): both
#: arms at once, judged by a paired preference rather than scored.
PAIR = "pair"
#: The arm of a request the experiment could not place: no ``user`` field and no subject header.
UNENROLLED = "unenrolled"
#: A request's subject when it has no OpenAI ``user`` field.
SUBJECT_HEADER = "x-steerserve-subject"
#: Completion ids remembered for feedback (oldest forgotten first).
MAX_REMEMBERED = 200_000
#: Scores accepted per answer: the last one counts (a changed vote); past this, 429.
MAX_FEEDBACK_PER_ID = 5
#: Preferences accepted per pair: one judgement (past it, 409: the first stands).
MAX_PREFERENCES_PER_PAIR = 1


def cap_for(metric: str) -> int:
    """How many values of ``metric`` one answer takes (all metrics of its kind together)."""
    return MAX_PREFERENCES_PER_PAIR if metric == PREFERENCE else MAX_FEEDBACK_PER_ID


class FeedbackLimit(Exception):
    """An answer's feedback was given :data:`MAX_FEEDBACK_PER_ID` times already (a pair's
    preference :data:`MAX_PREFERENCES_PER_PAIR` times)."""


class WrongKind(ValueError):
    """A preference for an answer that is not a pair, or a score for one that is: refused before
    anything is written, naming ``id``."""

    param = "id"


class DecisionNotLogged(Exception):
    """An answer whose decision line the log refused: a score for it could never be joined."""


class LogUnwritable(Exception):
    """The decision log refused a line (full disk): what it carried is lost."""


class StoreUnavailable(Exception):
    """The experiment store (``--ab-store``) cannot be reached now, or its queue here is full:
    a retry may succeed."""


def header_subject(raw: str) -> str:
    """A subject sent in :data:`SUBJECT_HEADER`: HTTP hands headers over as latin-1 text, while
    ``user`` in a JSON body is Unicode; re-read as UTF-8, the same person hashes to the same arm
    either way. ValueError when the bytes are not UTF-8."""
    try:
        return raw.encode("latin-1").decode("utf-8")
    except UnicodeError:
        raise ValueError(f"{SUBJECT_HEADER}: must be UTF-8 text") from None


@dataclass(frozen=True)
class Assignment:
    """A request's place in the experiment (echoed in the response as ``experiment``)."""

    name: str
    arm: str
    subject_hash: str
    phase: int = 1

    def echo(self) -> dict[str, str]:
        return {"name": self.name, "arm": self.arm, "subject_hash": self.subject_hash}


class Experiment:
    """The server's experiment as it runs now: its design (``design.py``), its phases (the last
    one current) and its status. Thread-safe: the registry (``registry.py``) replaces the phases
    when another replica or an admin changed them, while requests are assigned.

    ``Experiment(name, split)`` is the two-arm shorthand (``--ab-split``)."""

    def __init__(
        self,
        name: str = "default",
        split: float | None = None,
        *,
        design: Design | None = None,
        allocation: dict[str, float] | None = None,
        phases: list[Phase] | None = None,
        status: str = RUNNING,
        note: str = "",
    ) -> None:
        if design is None:
            design, allocation = two_arms(name, 0.0 if split is None else split)
        if allocation is None:
            allocation = {n: 1.0 / len(design.arms) for n in design.names}
        self.note = note
        self._lock = threading.Lock()
        self._specs: dict[tuple[str, str], SteeringSpec] = {}
        self.set(phases or [Phase(1, design, allocation, time.time(), None, "started")], status)

    def set(self, phases: list[Phase], status: str) -> None:
        """The phases as recorded (layouts recomputed from all of them) and the status."""
        last = layouts(phases)[-1]
        with self._lock:
            self.phases, self.status, self._layout = list(phases), status, last

    @property
    def phase(self) -> Phase:
        return self.phases[-1]

    @property
    def design(self) -> Design:
        return self.phase.design

    @property
    def name(self) -> str:
        return self.design.name

    @property
    def split(self) -> float:
        """The share of subjects in a treatment (the two-arm shorthand's split)."""
        return 1.0 - self.phase.allocation[self.design.control]

    @property
    def enabled(self) -> bool:
        """Whether any subject is in a treatment (a split of 0 is no experiment)."""
        return self.split > 0.0

    @property
    def running(self) -> bool:
        return self.status == RUNNING

    def assign(self, subject: str) -> Assignment:
        """The subject's arm in the current phase (``design.bucket`` and the phase's layout)."""
        b, digest = bucket(self.name, subject)
        with self._lock:
            names, owner = self._layout
            number = self.phases[-1].number
        return Assignment(self.name, names[int(owner[b])], digest, number)

    def spec(self, arm: str) -> SteeringSpec:
        """An arm's steering as the policy takes it (parsed once per arm; checked at start)."""
        from steerserve.server.steering import parse_steering

        value = self.design.arm(arm).steering
        key = (arm, repr(value))
        got = self._specs.get(key)
        if got is None:
            got = self._specs[key] = parse_steering(value) or Off()
        return got

    @staticmethod
    def steering(arm: str, default: str) -> SteeringSpec:
        """The two-arm shorthand's steering: the unsteered arm none; the steered arm ``auto``
        (English prompts are not steered), or ``on`` for every prompt when the server's default
        is ``on``. The default ``off`` does not turn the experiment off: the split is the
        opt-in."""
        if arm == UNSTEERED:
            return Off()
        return On() if default == "on" else Auto()


class DecisionLog:
    """Append-only JSONL of decisions and feedback, written by one process (each replica its own
    file). A line is in the log whole or not at all: a write that fails (full disk) never fails
    the request; it leaves nothing behind, is counted in ``failures`` and logged once."""

    def __init__(
        self,
        path: str | Path | None,
        content: bool = False,
        on_failure: Callable[[], None] | None = None,
    ) -> None:
        self.path = None if path is None else Path(path)
        self.content = content
        self.on_failure = on_failure  # e.g. a metric's increment
        self.failures = 0
        self._warned = False
        self._torn = False  # the file ends mid-line (a crash, a cut that failed): end it first
        self._lock = threading.Lock()
        self._fd: int | None = None
        if self.path is not None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                self._torn = _ends_mid_line(self.path)
            except OSError as e:
                raise ValueError(f"--ab-log: cannot write {str(self.path)!r}: {e}") from None

    @property
    def enabled(self) -> bool:
        return self._fd is not None

    def write(self, record: dict[str, Any]) -> bool:
        """Append one line, whole; False (counted, logged once) when it is not in the log."""
        if self.path is None:
            return True
        line = json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"
        # a lone surrogate (JSON allows one in a string) as its \u escape: the same JSON
        data = line.encode("utf-8", "backslashreplace")
        with self._lock:
            try:
                if self._fd is None:
                    raise OSError(errno.EBADF, "the log is closed")
                self._append(self._fd, b"\n" + data if self._torn else data)
                self._torn = False
                return True
            except OSError as e:
                self.failures += 1
                if self.on_failure is not None:
                    self.on_failure()
                if not self._warned:
                    self._warned = True
                    logger.error(
                        "decision log %s: write failed (%s); counting further ones", self.path, e
                    )
                return False

    def _append(self, fd: int, data: bytes) -> None:
        """``data`` at the end of the file unbuffered (nothing left to turn up later), or none of
        it: a short write (the disk filled mid-line) is cut back to where the line began."""
        done = 0
        try:
            while done < len(data):
                n = os.write(fd, data[done:])
                if n <= 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                done += n
        except OSError:
            if done:
                try:
                    os.ftruncate(fd, os.fstat(fd).st_size - done)
                except OSError:
                    self._torn = True
            raise

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                try:
                    os.close(self._fd)
                except OSError:
                    pass
                self._fd = None

    def known_ids(self) -> tuple[list[tuple[str, dict[str, Any]]], dict[str, int]]:
        """(id, decision) of the decisions already in the log, and how many scores each id got
        (for feedback after a restart)."""
        if self.path is None or not self.path.is_file():
            return [], {}
        out, scored = [], {}
        with open(self.path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except (ValueError, RecursionError):
                    continue  # a torn last line after a crash
                if not isinstance(rec, dict) or "id" not in rec:
                    continue
                if rec.get("type") == "decision":
                    out.append((str(rec["id"]), rec))
                elif rec.get("type") == "feedback":
                    scored[str(rec["id"])] = scored.get(str(rec["id"]), 0) + 1
        return out[-MAX_REMEMBERED:], scored


def _ends_mid_line(path: Path) -> bool:
    """Whether the regular file's last byte is not a newline (a line torn by a crash)."""
    if not stat.S_ISREG(path.stat().st_mode):
        return False  # a pipe or a device: nothing to read back
    with open(path, "rb") as f:
        if f.seek(0, os.SEEK_END) == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


class Decisions:
    """The completion ids this server answered and logged (bounded), and those whose decision line
    was lost, so their feedback is refused."""

    def __init__(self, log: DecisionLog, store: Any = None) -> None:
        self.log = log
        self.store = store  # ab_store.writer.Writer (not imported: it imports this module)
        self.registry: Any = None  # registry.Registry: the experiment's record, followed
        if store is not None:
            store.on_lost = self._forget
        self._seen: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._lost: OrderedDict[str, None] = OrderedDict()
        self._scored: dict[str, int] = {}  # scores given per remembered id
        self._lock = threading.Lock()
        known, scored = log.known_ids()
        for rid, rec in known:
            self._remember(rid, rec)
        self._scored = {rid: n for rid, n in scored.items() if rid in self._seen}

    def _remember(self, rid: str, rec: dict[str, Any]) -> None:
        with self._lock:
            self._seen[rid] = {k: rec.get(k) for k in ("experiment", "arm", "language")}
            while len(self._seen) > MAX_REMEMBERED:
                old, _ = self._seen.popitem(last=False)
                self._scored.pop(old, None)

    def _forget(self, rid: str) -> None:
        """``rid``'s decision is not in the log (its line was lost)."""
        with self._lock:
            self._lost[rid] = None
            while len(self._lost) > MAX_REMEMBERED:
                self._lost.popitem(last=False)

    @property
    def enabled(self) -> bool:
        """Whether decisions are kept anywhere (feedback needs it)."""
        return self.log.enabled or self.store is not None

    def close(self) -> None:
        """Close the log; drain the store's queue (bounded), keeping the rest for the next start."""
        if self.registry is not None:
            self.registry.close()
        self.log.close()
        if self.store is not None:
            self.store.close()

    def record(self, rid: str, decision: dict[str, Any]) -> bool:
        """Log one answered request and remember it for feedback; False if its line was lost.
        With a store the record is queued for it and appended to the write-ahead file (no wait
        for the store or the disk on the request's path)."""
        rec = {"type": "decision", "ts": round(time.time(), 3), "id": rid, **decision}
        if not self.log.content:
            rec.pop("prompt", None)
            rec.pop("reply", None)
        logged = self.log.write(rec)
        if self.store is not None:
            logged = self.store.put(rec)  # the log is an export: the store decides
        if not logged:
            self._forget(rid)
            return False
        self._remember(rid, rec)
        return True

    def get(self, rid: str) -> dict[str, Any] | None:
        with self._lock:
            return self._seen.get(rid)

    def feedback(self, rid: str, score: float, metric: str = FEEDBACK) -> dict[str, Any]:
        """Append feedback (or a pair's preference) for a known id; the last score per metric
        counts. Refusals raise (types below); nothing is written then."""
        score = ab_metrics.posted_metric(metric).check(score)
        if self.store is not None:
            return self._stored_feedback(rid, score, metric)
        known = self.get(rid)
        if known is None:
            with self._lock:
                lost = rid in self._lost
            raise DecisionNotLogged(rid) if lost else KeyError(rid)
        check_kind(rid, known.get("arm"), metric)
        self._count(rid, metric, check=True)
        line = _feedback_line(rid, score, metric)
        if not self.log.write(line):
            with self._lock:
                self._scored[rid] -= 1
            raise LogUnwritable(str(self.log.path))
        return known

    def _stored_feedback(self, rid: str, score: float, metric: str) -> dict[str, Any]:
        """Feedback with a store: straight into it (any replica's answer; the cap counted
        there), unless a record of ``rid`` still waits in this replica's queue or the store is
        unreachable and this replica answered ``rid``: then it queues behind (made durable
        before the answer), the cap counted here and again when written.
        :class:`StoreUnavailable`: neither was possible."""
        known = self.get(rid)
        with self._lock:
            lost = rid in self._lost
        if known is None and lost:
            raise DecisionNotLogged(rid)
        if known is not None:
            check_kind(rid, known.get("arm"), metric)
        rec = _feedback_line(rid, score, metric)
        rec["fid"] = uuid.uuid4().hex  # the same score written twice (a retry) counts once
        if known is None or not self.store.holds(rid):
            try:
                got = self.store.feedback(rec)
            except StoreUnavailable:
                if known is None:
                    raise
            else:
                self._count(rid, metric)
                self.log.write(_line(rec))
                return got
        self._count(rid, metric, check=True)
        if not self.store.put(rec, sync=True):
            with self._lock:
                self._scored[rid] -= 1
            raise StoreUnavailable("the experiment store's queue is full")
        self.log.write(_line(rec))
        return known

    def _count(self, rid: str, metric: str, check: bool = False) -> None:
        """One more score for a remembered ``rid``; ``check``: FeedbackLimit past the cap."""
        with self._lock:
            if rid not in self._seen:
                return
            if check and self._scored.get(rid, 0) >= cap_for(metric):
                raise FeedbackLimit(rid)
            self._scored[rid] = self._scored.get(rid, 0) + 1


def check_kind(rid: str, arm: Any, metric: str) -> None:
    """A pair takes a preference and nothing else; any other answer takes no preference."""
    if metric == PREFERENCE and arm != PAIR:
        raise WrongKind(
            f"id: {rid!r} is not a pair (an answer of /v1/chat/completions/ab): a preference "
            "judges the two answers of one pair"
        )
    if metric != PREFERENCE and arm == PAIR:
        raise WrongKind(
            f"id: {rid!r} is a pair (an answer of /v1/chat/completions/ab): judge it with POST "
            "/v1/steering/preference"
        )


def _feedback_line(rid: str, score: float, metric: str) -> dict[str, Any]:
    """A feedback record; the human score's without a ``metric`` key (as logs before metrics)."""
    rec = {"type": "feedback", "ts": round(time.time(), 3), "id": rid, "score": score}
    return rec if metric == FEEDBACK else rec | {"metric": metric}


def _line(rec: dict[str, Any]) -> dict[str, Any]:
    """A feedback record as the JSONL log's line (the store's idempotency key left out)."""
    return {k: v for k, v in rec.items() if k != "fid"}


@dataclass
class Enrolled:
    """A request under the server's A/B experiment: its ``experiment`` echo and, when enrolled,
    what the decision log gets once it is answered (``replies`` only with --ab-log-content)."""

    echo: ExperimentInfo
    rid: str = ""
    decision: dict[str, Any] | None = None
    replies: dict[tuple[int, int], str] | None = None  # (prompt, choice) -> text
    finished: dict[tuple[int, int], str | None] = field(default_factory=dict)  # finish reasons
    preset: str | None = None  # the arm's preset (--ab-preset, an arm preset:NAME)
    phase: int | None = None  # the experiment's phase it was assigned in
    pair: bool = False  # an answer of the A/B endpoint: both arms, judged by a preference

    def add_replies(self, i: int, out: Any) -> None:
        """A streamed step's text deltas of prompt ``i`` (and each choice's finish reason), for
        the reply's automatic metrics and, with --ab-log-content, the log."""
        assert self.replies is not None
        for c in out.outputs:
            self.replies[i, c.index] = self.replies.get((i, c.index), "") + c.text
            self.finished[i, c.index] = getattr(c, "finish_reason", None)
