"""Where the server's experiment is recorded and how replicas agree on it: in the experiment
store when the server has one (every replica creates or joins it at start, then follows it: a
phase another replica or an admin started is picked up within :data:`REFRESH_SECONDS`), else in
this process, its phases written to the decision log as lines of their own, so the report knows
each phase's allocation without being told.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from steerserve.server.ab.design import (
    RUNNING,
    STOPPED,
    Design,
    DesignError,
    Phase,
    check_allocation,
    counts,
    layouts,
)
from steerserve.server.ab.experiment import DecisionLog, Experiment, StoreUnavailable
from steerserve.server.ab.store.experiments import Registered, _shares

if TYPE_CHECKING:
    from steerserve.server.ab.store.writer import Writer

logger = logging.getLogger(__name__)

#: Seconds between a replica's reads of the registry (another replica's ramp, an admin's stop).
REFRESH_SECONDS = 2.0


class Registry:
    """The server's experiment (``experiment``, kept current) and its record."""

    def __init__(
        self, experiment: Experiment, writer: Writer | None, log: DecisionLog, by: str
    ) -> None:
        self.experiment, self.writer, self.log, self.by = experiment, writer, log, by
        self.read_error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # --- at start ---------------------------------------------------------------------------

    def join(self) -> str:
        """Create the experiment or join it (``store.experiments.ensure``; without a store, from
        the log's phase lines); what happened, in words. ``Conflict`` or ``DesignError``
        (ValueErrors naming their option) stop the start."""
        exp = self.experiment
        design, allocation = exp.design, exp.phase.allocation
        if self.writer is not None:
            from steerserve.server.ab.store import experiments

            got = experiments.ensure(self.writer.store, design, allocation, exp.note, self.by)
        else:
            got = self._join_log(design, allocation)
        logged = {(p.number, p.ended) for p in logged_phases(self.log, design.name)[0]}
        self._apply(got, logged)
        return got.event

    def _join_log(self, design: Design, allocation: Mapping[str, float]) -> Registered:
        """The log's record of this experiment continued when the configuration is the same, a
        new phase when it changed, phase 1 when the log has none."""
        phases, status = logged_phases(self.log, design.name)
        now = time.time()
        if not phases:
            return Registered([Phase(1, design, dict(allocation), now, None, f"created by {self.by}")],
                              RUNNING, self.experiment.note, "created")  # fmt: skip
        last = phases[-1]
        same = last.design.difference(design) is None
        if same and counts(last.allocation, design.names) == counts(allocation, design.names):
            return Registered(phases, status, self.experiment.note, "joined")
        what = "allocation" if same else "arms"
        why = f"{what} changed by {self.by}: {_shares(last.allocation, allocation)}"
        return Registered(_next(phases, design, dict(allocation), why, now), RUNNING,
                          self.experiment.note, f"phase {len(phases) + 1}")  # fmt: skip

    # --- following the record ---------------------------------------------------------------

    def start(self) -> None:
        """Follow the store's record (a thread; nothing to follow without a store)."""
        if self.writer is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._follow, name="ab-registry", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)

    def _follow(self) -> None:
        while not self._stop.wait(REFRESH_SECONDS):
            self.refresh()

    def refresh(self) -> None:
        """Read the record once (the store down: the last one read stays, said on the page)."""
        from steerserve.server.ab.store import StoreError, experiments

        assert self.writer is not None
        try:
            got = experiments.load(self.writer.store, self.experiment.name)
        except (StoreUnavailable, StoreError) as e:
            self.read_error = str(e)
            return
        self.read_error = None
        if got is not None:
            self._apply(got)

    def _apply(self, got: Registered, logged: set[tuple[int, float | None]] | None = None) -> None:
        """Make ``got`` the experiment's phases and status; a phase new to this process is
        logged (and written to the JSONL log as its own line, unless ``logged`` has it)."""
        exp = self.experiment
        with self._lock:
            now = {(p.number, p.ended) for p in got.phases}
            before = {(p.number, p.ended) for p in exp.phases} if logged is None else logged
            if logged is None and got.status == exp.status and before == now:
                return
            exp.set(got.phases, got.status)
            exp.note = got.note or exp.note
        for ph in got.phases:
            if (ph.number, ph.ended) not in before:
                self.log.write(ph.record())
        self.log.write(self._status_line())
        ph = exp.phase
        logger.info(
            "A/B experiment %r: %s, phase %d (%s), allocation %s%s",
            exp.name,
            exp.status,
            ph.number,
            ph.why,
            ", ".join(f"{n} {s:.4g}" for n, s in ph.allocation.items()),
            "" if got.event == "joined" else f" [{got.event}]",
        )

    def _status_line(self) -> dict[str, Any]:
        exp = self.experiment
        return {
            "type": "experiment",
            "ts": round(time.time(), 3),
            "experiment": exp.name,
            "status": exp.status,
            "note": exp.note,
            "phase": exp.phase.number,
        }

    # --- an admin's changes (the page's controls) ------------------------------------------

    def change(self, allocation: Mapping[str, Any], why: str, by: str) -> Registered:
        """A new phase with ``allocation`` (DesignError naming ``allocation``: not shares of
        the arms summing to 1, or a treatment that would take another arm's subjects)."""
        exp = self.experiment
        shares = check_allocation(allocation, exp.design, "allocation")
        if self.writer is not None:
            from steerserve.server.ab.store import experiments

            got = experiments.change(self.writer.store, exp.name, shares, why, by)
        else:
            text = why or "allocation changed " + _shares(exp.phase.allocation, shares)
            got = Registered(_next(exp.phases, exp.design, shares, f"{text} (by {by})",
                                   time.time()), RUNNING, exp.note, "changed")  # fmt: skip
        self._apply(got)
        return got

    def set_status(self, status: str, why: str, by: str) -> Registered:
        """Stop the experiment (its phase ends; requests are served as without one) or start
        it again (a new phase, the last one's arms and allocation)."""
        exp = self.experiment
        if self.writer is not None:
            from steerserve.server.ab.store import experiments

            got = experiments.set_status(self.writer.store, exp.name, status, why, by)
        elif status == exp.status:
            got = Registered(exp.phases, status, exp.note, f"already {status}")
        elif status == STOPPED:
            last = exp.phase
            ended = Phase(last.number, last.design, last.allocation, last.started, time.time(),
                          last.why)  # fmt: skip
            got = Registered([*exp.phases[:-1], ended], STOPPED, exp.note, "stopped")
        else:
            text = f"started again: {why} (by {by})" if why else f"started again by {by}"
            got = Registered(_next(exp.phases, exp.design, exp.phase.allocation, text,
                                   time.time()), RUNNING, exp.note, "started")  # fmt: skip
        self._apply(got)
        return got

    def describe(self) -> dict[str, Any]:
        """The experiment as the page and the API show it."""
        exp = self.experiment
        return {
            "name": exp.name,
            "status": exp.status,
            "note": exp.note,
            "control": exp.design.control,
            "arms": exp.design.record(),
            "phase": exp.phase.number,
            "allocation": exp.phase.allocation,
            "phases": [{k: v for k, v in p.record().items() if k != "type"} for p in exp.phases],
            "recorded_in": "store" if self.writer is not None else "log",
            "read_error": self.read_error,
        }


def _next(
    phases: list[Phase], design: Design, allocation: dict[str, float], why: str, now: float
) -> list[Phase]:
    """``phases`` with the current one ended and a new one after it (its layout checked)."""
    last = phases[-1]
    ended = last if last.ended is not None else Phase(last.number, last.design, last.allocation,
                                                       last.started, now, last.why)  # fmt: skip
    out = [*phases[:-1], ended, Phase(last.number + 1, design, allocation, now, None, why)]
    layouts(out)  # DesignError: a treatment would take another arm's subjects
    return out


def logged_phases(log: DecisionLog, name: str) -> tuple[list[Phase], str]:
    """The phases of experiment ``name`` a decision log holds (the latest line of each), and
    its last status."""
    if log.path is None or not log.path.is_file():
        return [], RUNNING
    found: dict[int, Phase] = {}
    status = RUNNING
    with open(log.path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if '"phase"' not in line or name not in line:
                continue
            try:
                rec = json.loads(line)
                if rec.get("experiment") != name:
                    continue
                if rec.get("type") == "phase":
                    found[int(rec["phase"])] = Phase.of(rec)
                elif rec.get("type") == "experiment":
                    status = str(rec.get("status") or RUNNING)
            except (ValueError, KeyError, TypeError, DesignError):
                continue  # a torn or foreign line: the report counts it
    return [found[k] for k in sorted(found)], status
