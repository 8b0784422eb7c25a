"""The experiment registry's rows in the store: each experiment's arms, control, status, owner
note and the configuration ``serve`` last gave it (``flags``), and its phases. Every change is
one transaction that locks the experiment's row first, so replicas starting together, or an
admin and a starting replica, take turns: one creates, the others join.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from steerserve.server.ab.design import (
    RUNNING,
    STOPPED,
    Design,
    DesignError,
    Phase,
    counts,
    layouts,
)
from steerserve.server.ab.store import schema
from steerserve.server.ab.store.schema import EXPERIMENTS, PHASES

if TYPE_CHECKING:  # duck-typed: base.py reads these rows (records), so it cannot be imported
    from typing import Any as Store
    from typing import Any as _Cursor


class Conflict(ValueError):
    """A replica started with other arms than the running experiment of the same name."""


@dataclass
class Registered:
    """An experiment as the registry holds it, and what the call did (``event``)."""

    phases: list[Phase]
    status: str
    note: str
    event: str = "joined"

    @property
    def phase(self) -> Phase:
        return self.phases[-1]


def flags_of(design: Design, allocation: Mapping[str, float]) -> str:
    """A configuration as ``serve`` gave it, in a form two replicas' flags compare equal in."""
    shares = counts(allocation, design.names)
    return schema.to_json({"arms": design.record(), "control": design.control, "buckets": shares})


def ensure(
    store: Store, design: Design, allocation: Mapping[str, float], note: str, by: str
) -> Registered:
    """Create the experiment, or join it: a configuration other than the one ``serve`` last
    gave it (a ramp) starts a new phase; other arms than the running phase's are refused
    (:class:`Conflict`, naming the difference), and start a new phase once it is stopped."""
    now, mine = time.time(), flags_of(design, allocation)
    with store._tx() as cur:
        cur.execute(
            f"INSERT INTO {EXPERIMENTS} (name, arms, control, status, note, flags, phase, "
            "created, updated) VALUES (?, ?, ?, ?, ?, ?, 1, ?, ?) ON CONFLICT (name) DO NOTHING",
            (design.name, schema.to_json(design.record()), design.control, RUNNING, note or None,
             mine, now, now),
        )  # fmt: skip
        created = cur.rowcount == 1
        row = _row(store, cur, design.name)
        if created:
            first = Phase(1, design, dict(allocation), now, None, f"created by {by}")
            _insert(cur, first, by)
            return Registered([first], RUNNING, note, "created")
        phases, status, known_note, flags = _phases(cur, design.name), row[0], row[1] or "", row[2]
        current = phases[-1].design
        diff = current.difference(design)
        if diff and status == RUNNING:
            raise Conflict(
                f"experiment {design.name!r} runs with other arms ({diff}; 'there': phase "
                f"{phases[-1].number}, in the store): stop it first, or use another --ab-name"
            )
        if current.control != design.control:
            raise DesignError(
                f"the control of {design.name!r} is {current.control!r}: an experiment keeps "
                "its control (use another --ab-name)",
                "--ab-control",
            )
        if not diff and flags == mine:
            return Registered(phases, status, known_note, "joined")
        what = "arms" if diff else "allocation"
        why = f"{what} changed by {by}: " + _shares(phases[-1].allocation, allocation)
        got = _new_phase(cur, phases, design, dict(allocation), why, by, now)
        _update(cur, design.name, RUNNING, note or known_note, now, got.phase, design, mine)
        return Registered(got.phases, RUNNING, note or known_note, f"phase {got.phase.number}")


def change(
    store: Store, name: str, allocation: Mapping[str, float], why: str, by: str
) -> Registered:
    """A new phase with ``allocation`` (checked against the arms: ``design.check_allocation``,
    and against the layout: a treatment grows only into the control's share)."""
    now = time.time()
    with store._tx() as cur:
        row = _row(store, cur, name)
        phases = _phases(cur, name)
        design = phases[-1].design
        text = why or "allocation changed " + _shares(phases[-1].allocation, allocation)
        got = _new_phase(cur, phases, design, dict(allocation), f"{text} (by {by})", by, now)
        _update(cur, name, RUNNING, row[1] or "", now, got.phase, design, row[2])
        return Registered(got.phases, RUNNING, row[1] or "", f"phase {got.phase.number}")


def set_status(store: Store, name: str, status: str, why: str, by: str) -> Registered:
    """Stop (the current phase ends now) or start again (a new phase with the last phase's
    arms and allocation: a stop is never pooled over)."""
    now = time.time()
    with store._tx() as cur:
        row = _row(store, cur, name)
        phases = _phases(cur, name)
        last = phases[-1]
        if row[0] == status:
            return Registered(phases, status, row[1] or "", f"already {status}")
        if status == STOPPED:
            cur.execute(
                f"UPDATE {PHASES} SET ended = ? WHERE experiment = ? AND phase = ?",
                (now, name, last.number),
            )
            phases[-1] = Phase(last.number, last.design, last.allocation, last.started, now,
                               last.why)  # fmt: skip
            _update(cur, name, STOPPED, row[1] or "", now, last, last.design, row[2])
            return Registered(phases, STOPPED, row[1] or "", f"stopped: {why} (by {by})")
        text = f"started again: {why} (by {by})" if why else f"started again by {by}"
        got = _new_phase(cur, phases, last.design, last.allocation, text, by, now)
        _update(cur, name, RUNNING, row[1] or "", now, got.phase, last.design, row[2])
        return Registered(got.phases, RUNNING, row[1] or "", f"phase {got.phase.number}")


def load(store: Store, name: str) -> Registered | None:
    """The experiment ``name`` as registered, or None."""
    with store._tx() as cur:
        cur.execute(f"SELECT status, note FROM {EXPERIMENTS} WHERE name = ?", (name,))
        row = cur.fetchone()
        if row is None:
            return None
        return Registered(_phases(cur, name), row[0], row[1] or "")


def _row(store: Store, cur: _Cursor, name: str) -> tuple[Any, ...]:
    """(status, note, flags) of ``name``, its row locked; LookupError when there is none."""
    cur.execute(
        f"SELECT status, note, flags FROM {EXPERIMENTS} WHERE name = ?{store.for_update}", (name,)
    )
    row = cur.fetchone()
    if row is None:
        raise LookupError(f"no experiment {name!r} in the store")
    return tuple(row)


def _phases(cur: _Cursor, name: str) -> list[Phase]:
    cur.execute(
        f"SELECT experiment, phase, arms, control, allocation, started, ended, why FROM {PHASES} "
        "WHERE experiment = ? ORDER BY phase",
        (name,),
    )
    keys = ("experiment", "phase", "arms", "control", "allocation", "started", "ended", "why")
    out = []
    for row in cur.fetchall():
        rec = dict(zip(keys, row, strict=True))
        rec["arms"], rec["allocation"] = json.loads(rec["arms"]), json.loads(rec["allocation"])
        out.append(Phase.of(rec))
    return out


def _new_phase(
    cur: _Cursor,
    phases: list[Phase],
    design: Design,
    allocation: dict[str, float],
    why: str,
    by: str,
    now: float,
) -> Registered:
    """The next phase, checked (its layout follows from the ones before), the current one
    ended."""
    last = phases[-1]
    phase = Phase(last.number + 1, design, allocation, now, None, why)
    layouts([*phases, phase])  # DesignError: a treatment would take another arm's subjects
    if last.ended is None:
        cur.execute(
            f"UPDATE {PHASES} SET ended = ? WHERE experiment = ? AND phase = ?",
            (now, design.name, last.number),
        )
        phases = [*phases[:-1], Phase(last.number, last.design, last.allocation, last.started,
                                      now, last.why)]  # fmt: skip
    _insert(cur, phase, by)
    return Registered([*phases, phase], RUNNING, "")


def _insert(cur: _Cursor, phase: Phase, by: str) -> None:
    cur.execute(
        f"INSERT INTO {PHASES} (experiment, phase, arms, control, allocation, started, ended, "
        "why, by_replica) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (phase.design.name, phase.number, schema.to_json(phase.design.record()),
         phase.design.control, schema.to_json(phase.allocation), phase.started, phase.ended,
         schema.text(phase.why), by),
    )  # fmt: skip


def _update(
    cur: _Cursor,
    name: str,
    status: str,
    note: str,
    now: float,
    phase: Phase,
    design: Design,
    flags: str | None,
) -> None:
    cur.execute(
        f"UPDATE {EXPERIMENTS} SET arms = ?, control = ?, status = ?, note = ?, flags = ?, "
        "phase = ?, updated = ? WHERE name = ?",
        (schema.to_json(design.record()), design.control, status, note or None, flags,
         phase.number, now, name),
    )  # fmt: skip


def _shares(before: Mapping[str, float], after: Mapping[str, float]) -> str:
    """An allocation change in words: ``steered 0.2 -> 0.5, unsteered 0.8 -> 0.5``."""
    names = list(dict.fromkeys([*before, *after]))
    parts = [
        f"{n} {before.get(n, 0):.4g} -> {after.get(n, 0):.4g}"
        for n in names
        if abs(before.get(n, 0) - after.get(n, 0)) > 1e-9
    ]
    return ", ".join(parts) or "the same shares"
