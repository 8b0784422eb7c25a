"""A server-side A/B experiment: a sticky split of subjects (users) into a steered and an
unsteered arm, a JSONL decision log, and feedback joined to it.

The arm is a pure function of (experiment name, subject): the same user lands in the same arm on
every request and across restarts, and renaming the experiment reshuffles. The log is append-only;
feedback is appended as its own line and joined by completion id when the report is built, so no
line is ever rewritten.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from steerserve.server.steering import Auto, Off, On, SteeringSpec

logger = logging.getLogger(__name__)

STEERED, UNSTEERED = "steered", "unsteered"
#: The arm of a request the experiment could not place: no ``user`` field and no subject header.
UNENROLLED = "unenrolled"
#: A request's subject when it has no OpenAI ``user`` field.
SUBJECT_HEADER = "x-steerserve-subject"
#: Completion ids remembered for feedback (oldest forgotten first).
MAX_REMEMBERED = 200_000


@dataclass(frozen=True)
class Assignment:
    """A request's place in the experiment (echoed in the response as ``experiment``)."""

    name: str
    arm: str
    subject_hash: str

    def echo(self) -> dict[str, str]:
        return {"name": self.name, "arm": self.arm, "subject_hash": self.subject_hash}


@dataclass(frozen=True)
class Experiment:
    """``split`` of the subjects get the steered arm; 0 turns the experiment off."""

    name: str = "default"
    split: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.split, int | float) and 0.0 <= self.split <= 1.0):
            raise ValueError(f"--ab-split: {self.split!r} is not in [0, 1]")
        if not self.name or len(self.name) > 100:
            raise ValueError("--ab-name: must be 1-100 characters")

    @property
    def enabled(self) -> bool:
        return self.split > 0.0

    def assign(self, subject: str) -> Assignment:
        """The subject's arm: a uniform number from sha256(name, subject) compared to ``split``."""
        digest = hashlib.sha256(f"{self.name}\x00{subject}".encode()).hexdigest()
        u = int(digest[:15], 16) / 16**15
        return Assignment(self.name, STEERED if u < self.split else UNSTEERED, digest[:16])

    @staticmethod
    def steering(arm: str, default: str) -> SteeringSpec:
        """An arm's steering: the unsteered arm none; the steered arm ``auto`` (English prompts
        are not steered), or ``on`` for every prompt when the server's default is ``on``. The
        default ``off`` does not turn the experiment off: the split is the opt-in."""
        if arm == UNSTEERED:
            return Off()
        return On() if default == "on" else Auto()


class DecisionLog:
    """Append-only JSONL of decisions and feedback. A write that fails (full disk) never fails
    the request: it is counted in ``failures`` and logged once, not per request."""

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
        self._lock = threading.Lock()
        self._file: Any = None
        if self.path is not None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open
            except OSError as e:
                raise ValueError(f"--ab-log: cannot write {str(self.path)!r}: {e}") from None

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def write(self, record: dict[str, Any]) -> bool:
        """Append one line; False (counted, logged once) when the write failed."""
        if self._file is None:
            return True
        line = json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"
        with self._lock:
            try:
                self._file.write(line)
                self._file.flush()
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

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                try:
                    self._file.close()
                except OSError:
                    pass
                self._file = None

    def known_ids(self) -> list[tuple[str, dict[str, Any]]]:
        """(id, decision) of the decisions already in the log (for feedback after a restart)."""
        if self.path is None or not self.path.is_file():
            return []
        out = []
        with open(self.path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a torn last line after a crash
                if isinstance(rec, dict) and rec.get("type") == "decision" and "id" in rec:
                    out.append((str(rec["id"]), rec))
        return out[-MAX_REMEMBERED:]


class Decisions:
    """The completion ids this server answered (bounded), so feedback can be checked and joined."""

    def __init__(self, log: DecisionLog) -> None:
        self.log = log
        self._seen: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._lock = threading.Lock()
        for rid, rec in log.known_ids():
            self._remember(rid, rec)

    def _remember(self, rid: str, rec: dict[str, Any]) -> None:
        with self._lock:
            self._seen[rid] = {k: rec.get(k) for k in ("experiment", "arm", "language")}
            while len(self._seen) > MAX_REMEMBERED:
                self._seen.popitem(last=False)

    def record(self, rid: str, decision: dict[str, Any]) -> bool:
        """Remember and log one answered request; False if the log write failed."""
        rec = {"type": "decision", "ts": round(time.time(), 3), "id": rid, **decision}
        if not self.log.content:
            rec.pop("prompt", None)
            rec.pop("reply", None)
        self._remember(rid, rec)
        return self.log.write(rec)

    def get(self, rid: str) -> dict[str, Any] | None:
        with self._lock:
            return self._seen.get(rid)

    def feedback(self, rid: str, score: float) -> dict[str, Any]:
        """Append feedback for a known id (``KeyError``: unknown; ``ValueError``: bad score)."""
        if (
            isinstance(score, bool)
            or not isinstance(score, int | float)
            or not math.isfinite(score)
        ):
            raise ValueError(f"score: must be a finite number, got {score!r}")
        known = self.get(rid)
        if known is None:
            raise KeyError(rid)
        self.log.write({"type": "feedback", "ts": round(time.time(), 3), "id": rid, "score": score})
        return known
