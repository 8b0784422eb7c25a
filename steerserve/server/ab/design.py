"""An experiment's design as a record: its arms (one the control), the allocation of subjects, and
its phases, each analysed alone, never pooled."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from steerserve.engine.spec import short_repr
from steerserve.server.presets import check_name, parse_option

#: The resolution of an allocation: shares are kept as counts of this many buckets.
BUCKETS = 10_000
#: The two-arm shorthand (``--ab-split``): its arms' names, as the reports before arms had them.
STEERED, UNSTEERED = "steered", "unsteered"
#: Names an arm cannot take (the answer's ``arm`` uses them for requests outside the arms).
RESERVED = frozenset({"pair", "unenrolled", "none", "stopped"})
RUNNING, STOPPED = "running", "stopped"
#: How far shares may miss 1 in their sum (a decimal written by hand: 0.1 + 0.2 + 0.7).
SUM_TOLERANCE = 1e-6


class DesignError(ValueError):
    """A design, allocation or phase change refused, naming the field (a flag at start, a JSON
    field through the API)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.reason = message


@dataclass(frozen=True)
class Arm:
    """One arm: a ``steering`` value as a request would send it (``False``: unsteered), or a
    preset's name (its steering, served by ``--preset`` or the artifact)."""

    name: str
    steering: Any = False
    preset: str | None = None

    @property
    def spec(self) -> str:
        """The arm as ``--ab-arm`` spells it after the name: off | on | auto | preset:NAME |
        JSON (the form compared between replicas)."""
        if self.preset is not None:
            return f"preset:{self.preset}"
        words = {False: "off", True: "on", "auto": "auto", "off": "off", "on": "on"}
        if isinstance(self.steering, bool | str) and self.steering in words:
            return words[self.steering]
        import json

        return json.dumps(self.steering, sort_keys=True, separators=(",", ":"))

    def record(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "spec": self.spec}
        return out

    @classmethod
    def of(cls, rec: Mapping[str, Any]) -> Arm:
        """An arm from its record (``record()``), as a store or a log line holds it."""
        return parse_arm(f"{rec['name']}={rec['spec']}")


def parse_arm(text: str, param: str = "--ab-arm") -> Arm:
    """``NAME=SPEC``: SPEC ``off``, ``on``, ``auto``, a ``steering`` value as JSON, or
    ``preset:NAME``. The steering value's own checks run where the server reads it
    (:func:`check_arms`)."""
    name, sep, spec = text.partition("=")
    name, spec = name.strip(), spec.strip()
    if spec.startswith("preset:"):
        preset = spec.removeprefix("preset:").strip()
        try:
            check_name(name)
            check_name(preset)
        except ValueError as e:
            raise DesignError(str(e), param) from None
        return _named(Arm(name, None, preset), param)
    try:
        name, value = parse_option(text)
    except ValueError as e:
        msg = str(e).replace("preset name", "arm name")
        if not sep:
            msg = (
                f"{short_repr(text)}: expected NAME=SPEC (SPEC: off, on, auto, JSON or preset:NAME)"
            )
        raise DesignError(msg, param) from None
    return _named(Arm(name, value), param)


def _named(arm: Arm, param: str) -> Arm:
    if arm.name in RESERVED:
        raise DesignError(f"{arm.name!r} is reserved (not an arm name)", param)
    return arm


@dataclass(frozen=True)
class Design:
    """An experiment's arms; ``control`` is the one every treatment is compared with."""

    name: str
    arms: tuple[Arm, ...]
    control: str

    def __post_init__(self) -> None:
        if not self.name or len(self.name) > 100:
            raise DesignError("must be 1-100 characters", "--ab-name")
        names = [a.name for a in self.arms]
        if len(names) < 2:
            raise DesignError(f"an experiment needs two arms or more, got {len(names)}", "--ab-arm")
        if len(set(names)) < len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise DesignError(f"the arm {dup!r} is named twice", "--ab-arm")
        if self.control not in names:
            raise DesignError(
                f"{self.control!r} is not an arm ({', '.join(names)})", "--ab-control"
            )

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.arms)

    @property
    def treatments(self) -> tuple[str, ...]:
        return tuple(n for n in self.names if n != self.control)

    def arm(self, name: str) -> Arm:
        return next(a for a in self.arms if a.name == name)

    def difference(self, other: Design) -> str | None:
        """What differs between two designs of one experiment, in words (None: nothing)."""
        mine = {a.name: a.spec for a in self.arms}
        theirs = {a.name: a.spec for a in other.arms}
        parts = []
        if self.control != other.control:
            parts.append(f"control {other.control!r} here, {self.control!r} there")
        for name in sorted(mine.keys() | theirs.keys()):
            if name not in theirs:
                parts.append(f"arm {name}={mine[name]} there, not here")
            elif name not in mine:
                parts.append(f"arm {name}={theirs[name]} here, not there")
            elif mine[name] != theirs[name]:
                parts.append(f"arm {name} is {theirs[name]} here, {mine[name]} there")
        return "; ".join(parts) or None

    def record(self) -> list[dict[str, Any]]:
        return [a.record() for a in self.arms]


def two_arms(
    name: str, split: float, steered: Arm | None = None
) -> tuple[Design, dict[str, float]]:
    """The ``--ab-split`` shorthand: ``unsteered`` (the control, off) and ``steered`` (``auto``
    unless ``steered`` says otherwise), ``split`` of the subjects steered."""
    if not (isinstance(split, int | float) and 0.0 <= split <= 1.0):
        raise DesignError(f"{split!r} is not in [0, 1]", "--ab-split")
    arm = steered or Arm(STEERED, "auto")
    design = Design(name, (Arm(UNSTEERED, False), arm), UNSTEERED)
    return design, {STEERED: float(split), UNSTEERED: 1.0 - float(split)}


def parse_allocation(
    texts: Iterable[str], design: Design, param: str = "--ab-allocation"
) -> dict[str, float]:
    """``NAME=SHARE`` items (repeatable, or comma-separated) as a checked allocation; none:
    equal shares."""
    given: dict[str, Any] = {}
    for text in texts:
        for item in filter(None, (t.strip() for t in text.split(","))):
            name, sep, share = item.partition("=")
            if not sep:
                raise DesignError(f"{short_repr(item)}: expected NAME=SHARE", param)
            try:
                given[name.strip()] = float(share)
            except ValueError:
                raise DesignError(f"{short_repr(item)}: the share is not a number", param) from None
    if not given:
        return {n: 1.0 / len(design.arms) for n in design.names}
    return check_allocation(given, design, param)


def check_allocation(
    given: Mapping[str, Any], design: Design, param: str = "allocation"
) -> dict[str, float]:
    """Every arm's share, each in [0, 1], summing to 1 (an arm left out: 0); a share for a name
    that is not an arm, or one that is not a number, is refused naming ``param``."""
    out = {}
    for name, share in given.items():
        if name not in design.names:
            raise DesignError(
                f"{short_repr(name)} is not an arm ({', '.join(design.names)})", param
            )
        if (
            isinstance(share, bool)
            or not isinstance(share, int | float)
            or not math.isfinite(share)
        ):
            raise DesignError(f"{name}: the share must be a number, got {short_repr(share)}", param)
        if share < 0:
            raise DesignError(f"{name}'s share {share:g} is below 0", param)
        if share > 1:
            raise DesignError(f"{name}'s share {share:g} is above 1", param)
        out[name] = float(share)
    total = sum(out.values())
    if abs(total - 1.0) > SUM_TOLERANCE:
        raise DesignError(f"the shares sum to {total:.6g}, not 1", param)
    return {n: out.get(n, 0.0) for n in design.names}


def counts(allocation: Mapping[str, float], names: Sequence[str]) -> dict[str, int]:
    """Buckets per arm: the largest-remainder rounding of the shares (ties to the arm named
    first), so they always add up to :data:`BUCKETS`."""
    raw = [allocation.get(n, 0.0) * BUCKETS for n in names]
    base = [math.floor(x + 1e-9) for x in raw]
    left = BUCKETS - sum(base)
    order = sorted(range(len(names)), key=lambda i: (-(raw[i] - base[i]), i))
    for i in order[: max(left, 0)]:
        base[i] += 1
    return dict(zip(names, base, strict=True))


@dataclass(frozen=True)
class Phase:
    """One period of an experiment with one allocation and one set of arms."""

    number: int
    design: Design
    allocation: dict[str, float] = field(hash=False)
    started: float
    ended: float | None = None
    why: str = ""

    def record(self) -> dict[str, Any]:
        """The phase as a log line and the API show it."""
        return {
            "type": "phase",
            "experiment": self.design.name,
            "phase": self.number,
            "arms": self.design.record(),
            "control": self.design.control,
            "allocation": self.allocation,
            "started": self.started,
            "ended": self.ended,
            "why": self.why,
        }

    @classmethod
    def of(cls, rec: Mapping[str, Any]) -> Phase:
        """A phase from its record (ValueError, or a DesignError, when it is not one)."""
        design = Design(
            str(rec["experiment"]), tuple(Arm.of(a) for a in rec["arms"]), str(rec["control"])
        )
        allocation = check_allocation(dict(rec["allocation"]), design)
        ended = rec.get("ended")
        return cls(
            int(rec["phase"]),
            design,
            allocation,
            float(rec["started"]),
            None if ended is None else float(ended),
            str(rec.get("why") or ""),
        )


def bucket(name: str, subject: str) -> tuple[int, str]:
    """(the subject's bucket, its hash as the records show it): sha256 of (name, subject), in
    integers only, so every machine computes the same."""
    digest = hashlib.sha256(f"{name}\x00{subject}".encode()).hexdigest()
    return int(digest[:15], 16) * BUCKETS // 16**15, digest[:16]


def layouts(phases: Sequence[Phase]) -> list[tuple[tuple[str, ...], NDArray[np.int16]]]:
    """Each phase's layout: (arm names, per bucket the index of the arm holding it)."""
    out: list[tuple[tuple[str, ...], NDArray[np.int16]]] = []
    owner: list[str] | None = None
    for ph in phases:
        owner = next_owner(owner, ph.design, ph.allocation)
        names = ph.design.names
        index = {n: i for i, n in enumerate(names)}
        out.append((names, np.array([index[o] for o in owner], dtype=np.int16)))
    return out


def next_owner(
    prev: list[str] | None, design: Design, allocation: Mapping[str, float]
) -> list[str]:
    """The arm holding each bucket after a phase starts with ``allocation`` (``prev``: before;
    None: the first phase, every bucket the control's). DesignError when a treatment would grow
    by more than the control held before (it could only take a subject from another arm)."""
    control = design.control
    if prev is None:
        prev = [control] * BUCKETS
    target = counts(allocation, design.names)
    owner = [o if o in design.names else control for o in prev]  # a removed arm's go back
    held: dict[str, list[int]] = {}
    for b, o in enumerate(owner):
        held.setdefault(o, []).append(b)
    for t in design.treatments:  # shrink first: the highest buckets go back to the control
        mine = held.get(t, [])
        for b in mine[target[t] :] if len(mine) > target[t] else []:
            owner[b] = control
    takable = [b for b, o in enumerate(prev) if o == control]  # the control's before this phase
    growth = {t: max(target[t] - len(held.get(t, [])), 0) for t in design.treatments}
    if sum(growth.values()) > len(takable):
        grown = ", ".join(f"{t} by {g / BUCKETS:.4g}" for t, g in growth.items() if g)
        raise DesignError(
            f"{grown} would take more than the {len(takable) / BUCKETS:.4g} the control "
            f"{control!r} held: a treatment grows only into the control's share (shrink the "
            "others in one phase, grow it in the next)",
            "allocation",
        )
    at = 0
    for t in design.treatments:
        for b in takable[at : at + growth[t]]:
            owner[b] = t
        at += growth[t]
    return owner
