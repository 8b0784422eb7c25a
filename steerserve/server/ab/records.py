"""A decision log's (or an experiment store's) records as rows the report stands on: each answered
request joined with its feedback by completion id, its automatic metrics computed from what the
record says (``metrics.automatic``), and every line it cannot stand on counted by why.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from steerserve.engine.spec import finite_number
from steerserve.server.ab import metrics as ab_metrics

#: Keys of a decision's ``values`` set from its own fields when a row is built by hand (tests).
FEEDBACK = "feedback"


@dataclass
class Row:
    """One answered request: its place in the experiment and its metric values (automatic ones
    from the record, feedback joined by id: an answer's last score per metric counts)."""

    id: str
    experiment: str | None
    arm: str | None
    language: str | None
    latency_ms: float | None
    score: float | None = None  # the human feedback score (``values["feedback"]``)
    subject_hash: str | None = None  # who the split assigned (the unit of the statistics)
    ts: float | None = None
    applied: bool | None = None  # the steered arm's steering applied (None: not recorded)
    values: dict[str, float] = field(default_factory=dict)
    phase: int | None = None  # the experiment's phase it was assigned in (None: not recorded)
    treatment: str | None = None  # a pair's steered answer, in words (``pairs.py``)

    def __post_init__(self) -> None:
        if self.score is not None:
            self.values.setdefault(FEEDBACK, self.score)
        if self.latency_ms is not None:
            self.values.setdefault("latency_ms", self.latency_ms)

    def scored(self, metric: str, value: float) -> None:
        self.values[metric] = value
        if metric == FEEDBACK:
            self.score = value


@dataclass
class Ignored:
    """The lines of a log the report does not stand on, by why: every one is counted."""

    unreadable: int = 0  # not JSON (a torn line), wrong field types, a value out of range
    orphan_feedback: int = 0  # a score for an id with no decision line in the log
    unknown_metric: int = 0  # feedback for a metric this registry does not have

    @property
    def total(self) -> int:
        return self.unreadable + self.orphan_feedback + self.unknown_metric


def read_log(path: str | Path) -> list[Row]:
    """Decisions joined with their feedback by completion id (see :func:`scan_log`)."""
    return scan_log(path)[0]


def scan_log(path: str | Path) -> tuple[list[Row], Ignored]:
    """Decisions joined with their feedback by completion id, and the lines ignored: unreadable
    ones (not JSON, a torn last line included; a record whose fields have the wrong types or a
    value outside its metric's range), feedback for an id with no decision in the log (its
    decision line was lost) and feedback for a metric the registry lacks."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return scan_records(map(parse_line, f))


def parse_line(line: str) -> Any:
    """A log line's record, or None (a torn line: counted unreadable)."""
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        return None


def scan_records(records: Iterable[Any]) -> tuple[list[Row], Ignored]:
    """:func:`scan_log` of records already parsed (a log's lines, or an experiment store's rows
    in the same shape: one join for both)."""
    got = scan(records)
    return got.rows, got.ignored


@dataclass
class Scan:
    """What a log or a store holds: the rows, the lines ignored, and the experiments' own
    records (phases, by experiment and number: the latest line of each; status and note)."""

    rows: list[Row]
    ignored: Ignored
    phases: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)
    experiments: dict[str, dict[str, Any]] = field(default_factory=dict)


def scan(records: Iterable[Any]) -> Scan:
    """:func:`scan_records` with the experiments' phase and status records kept."""
    rows: dict[str, Row] = {}
    scores: dict[str, list[tuple[str, float]]] = {}
    ignored = Ignored()
    out = Scan([], ignored)
    for rec in records:
        kind = rec.get("type") if isinstance(rec, dict) else None
        if kind == "decision" and (row := _decision(rec)) is not None:
            rows[row.id] = row
        elif kind == "feedback" and (got := _feedback(rec, ignored)) is not None:
            scores.setdefault(rec["id"], []).append(got)
        elif kind == "phase" and _phase(rec):
            out.phases.setdefault(rec["experiment"], {})[rec["phase"]] = rec
        elif kind == "experiment" and isinstance(rec.get("experiment"), str):
            out.experiments[rec["experiment"]] = rec
        elif kind != "feedback":
            ignored.unreadable += 1
    for rid, given in scores.items():
        if rid not in rows:
            ignored.orphan_feedback += len(given)
            continue
        for metric, value in given:  # in order: the last per metric counts
            rows[rid].scored(metric, value)
    out.rows = list(rows.values())
    return out


def _phase(rec: dict[str, Any]) -> bool:
    """Whether a phase line has what a report needs (the rest is read by ``design.Phase.of``)."""
    ok = isinstance(rec.get("experiment"), str) and isinstance(rec.get("phase"), int)
    return ok and isinstance(rec.get("arms"), list) and isinstance(rec.get("allocation"), dict)


def _decision(rec: dict[str, Any]) -> Row | None:
    """A decision line as a :class:`Row`, or None when a field has the wrong type."""
    rid, latency, ts = rec.get("id"), rec.get("latency_ms"), rec.get("ts")
    names = [rec.get(k) for k in ("experiment", "arm", "language")]
    if not isinstance(rid, str) or not all(v is None or isinstance(v, str) for v in names):
        return None
    if latency is not None and (finite_number(latency) is None or latency < 0):
        return None
    applied, phase = rec.get("applied"), rec.get("phase")
    return Row(
        rid,
        *names,  # type: ignore[arg-type]
        latency_ms=None if latency is None else float(latency),
        subject_hash=_str_or_none(rec.get("subject_hash")),  # logs before it: per request
        ts=float(ts) if finite_number(ts) is not None else None,
        applied=applied if isinstance(applied, bool) else None,
        values=ab_metrics.automatic(rec),
        phase=phase if isinstance(phase, int) and not isinstance(phase, bool) else None,
        treatment=_str_or_none(rec.get("treatment")),
    )


def _str_or_none(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def _feedback(rec: dict[str, Any], ignored: Ignored) -> tuple[str, float] | None:
    """A feedback line's (metric, value), or None, counted: no string id or a value out of its
    metric's range (a ``true``, a NaN, a -1e308 a server before bounds took) is unreadable; a
    metric this registry does not know (another deployment's) is counted as such."""
    try:
        metric = ab_metrics.get(rec.get("metric", FEEDBACK))
    except ab_metrics.MetricError:
        ignored.unknown_metric += 1
        return None
    if not isinstance(rec.get("id"), str) or metric.kind == ab_metrics.AUTOMATIC:
        ignored.unreadable += 1
        return None
    try:
        return metric.name, metric.check(rec.get("score"))
    except ValueError:
        ignored.unreadable += 1
        return None
