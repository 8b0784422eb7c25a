"""The A/B metrics in one registry (direction, range, how each value is had), so stats and report
treat every metric alike and a deployment can add its own."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: The languages a multilingual model falls back to (its pivots): a reply in one of them to a
#: prompt in neither is the pivot leak.
PIVOTS = frozenset({"en", "zh"})
#: Finish reasons that mean the engine did not give a whole answer.
FAILED = frozenset({"abort", "error", "content_filter"})
AUTOMATIC, FEEDBACK, PAIRED = "automatic", "feedback", "paired"
#: The paired preference's metric (a pair's two answers judged: +1 B, -1 A, 0 a tie).
PREFERENCE = "preference"
#: A preference as posted, and its value: B (the steered answer) better, A (the unsteered
#: one) better, or a tie.
CHOICES = {"b": 1.0, "a": -1.0, "tie": 0.0}
#: What a metric is for in a verdict: the one the winner is called on, a guardrail (tested for
#: harm: the arm that is better on the primary does not win if it harms one), or a secondary.
PRIMARY, GUARDRAIL, SECONDARY = "primary", "guardrail", "secondary"


class MetricError(ValueError):
    """A metric value or name refused, with the request field it belongs to."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Metric:
    """One row of the registry. ``compute`` (automatic metrics) reads a decision record (the
    log's line) and returns the value or None (not measurable there); ``direction`` +1: higher
    is better, -1: lower is; ``relative``: the arms are compared as a ratio (b / a - 1, for a
    positive metric whose scale differs by deployment); ``tau``: the mSPRT's mixture scale in
    the compared units; ``effect``: the difference worth detecting ("sample still needed")."""

    name: str
    what: str
    direction: int
    lo: float
    hi: float
    kind: str = AUTOMATIC
    role: str = SECONDARY
    compute: Callable[[Mapping[str, Any]], float | None] | None = None
    relative: bool = False
    tau: float = 0.15
    effect: float = 0.05
    unit: str = ""

    def check(self, value: Any, param: str = "score") -> float:
        """``value`` as a float in the metric's range; :class:`MetricError` naming ``param``."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise MetricError(f"{param}: must be a number, got {type(value).__name__}", param)
        if not (math.isfinite(value) and self.lo <= value <= self.hi):
            raise MetricError(
                f"{param}: {self.name} takes a number in [{self.lo:g}, {self.hi:g}]", param
            )
        return float(value)

    def describe(self) -> dict[str, Any]:
        """The row as the report and the docs show it."""
        return {
            "name": self.name,
            "what": self.what,
            "kind": self.kind,
            "role": self.role,
            "direction": "higher is better" if self.direction > 0 else "lower is better",
            "range": [self.lo, self.hi if math.isfinite(self.hi) else None],
            "compared": "relative (steered / unsteered - 1)" if self.relative else "difference",
            "effect": self.effect,
            "unit": self.unit,
        }


def _choices(rec: Mapping[str, Any], key: str) -> list[Any] | None:
    v = rec.get(key)
    return v if isinstance(v, list) and v else None


def _mean(flags: Sequence[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def language_match(rec: Mapping[str, Any]) -> float | None:
    """Share of the answer's replies detected in the prompt's language."""
    prompt, replies = rec.get("language"), _choices(rec, "reply_language")
    if not isinstance(prompt, str) or replies is None:
        return None
    return _mean([r == prompt for r in replies if isinstance(r, str)])


def pivot_leak(rec: Mapping[str, Any]) -> float | None:
    """Share of replies in a pivot language (:data:`PIVOTS`) to a prompt in neither; None for a
    prompt in a pivot language (no leak to measure)."""
    prompt, replies = rec.get("language"), _choices(rec, "reply_language")
    if not isinstance(prompt, str) or prompt in PIVOTS or replies is None:
        return None
    return _mean([r in PIVOTS for r in replies if isinstance(r, str)])


def _number(key: str) -> Callable[[Mapping[str, Any]], float | None]:
    def read(rec: Mapping[str, Any]) -> float | None:
        v = rec.get(key)
        ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        return float(v) if ok and v >= 0 else None

    return read


def _finished(reasons: frozenset[str]) -> Callable[[Mapping[str, Any]], float | None]:
    def read(rec: Mapping[str, Any]) -> float | None:
        got = _choices(rec, "finish_reason")
        return None if got is None else _mean([r in reasons for r in got])

    return read


BUILTIN = (
    Metric(
        "feedback",
        "the score a client posted (1 thumbs up, 0 or -1 down)",
        +1,
        -1.0,
        1.0,
        kind=FEEDBACK,
        role=PRIMARY,
        effect=0.1,
    ),
    Metric(
        "language_match",
        "the reply is in the prompt's language (the translation failure, when not)",
        +1,
        0.0,
        1.0,
        role=PRIMARY,
        compute=language_match,
    ),
    Metric(
        "pivot_leak",
        "the reply is in English or Chinese although the prompt is in neither (the pivot)",
        -1,
        0.0,
        1.0,
        compute=pivot_leak,
    ),
    Metric(
        "latency_ms",
        "time from request to the last token, server side",
        -1,
        0.0,
        math.inf,
        role=GUARDRAIL,
        compute=_number("latency_ms"),
        relative=True,
        tau=0.1,
        effect=0.1,
        unit="ms",
    ),
    Metric(
        "completion_tokens",
        "tokens generated for the answer (cost)",
        -1,
        0.0,
        math.inf,
        role=GUARDRAIL,
        compute=_number("completion_tokens"),
        relative=True,
        tau=0.1,
        effect=0.1,
        unit="tokens",
    ),
    Metric(
        "truncated",
        "the reply hit max_tokens (finish reason length)",
        -1,
        0.0,
        1.0,
        role=GUARDRAIL,
        compute=_finished(frozenset({"length"})),
    ),
    Metric(
        "failed",
        "the engine did not finish the reply (finish reason abort, error or content_filter)",
        -1,
        0.0,
        1.0,
        role=GUARDRAIL,
        compute=_finished(FAILED),
        effect=0.02,
    ),
    Metric(
        PREFERENCE,
        "which answer of a pair was better: +1 B (the steered one), -1 A (the unsteered), 0 a tie",
        +1,
        -1.0,
        1.0,
        kind=PAIRED,
        role=PRIMARY,
        effect=0.1,
    ),
)
#: The metric the winner is called on when the report is not told: human feedback where the
#: experiment has any, else this (the failure steering exists to fix, measured on every reply).
PRIMARY_FALLBACK = "language_match"
ENTRY_POINTS = "steerserve.ab_metrics"

_registry: dict[str, Metric] = {m.name: m for m in BUILTIN}
_loaded = False


def register(metric: Metric) -> Metric:
    """Add a deployment's metric (a judge model's score: ``kind=FEEDBACK``; a value computed
    from the decision record: ``compute=``); ValueError for a name taken or a bad row."""
    if not metric.name.isidentifier() or metric.name in _registry:
        raise ValueError(f"metric {metric.name!r}: not an identifier, or registered already")
    if metric.kind == PAIRED:
        raise ValueError(f"metric {metric.name!r}: the paired metric is the server's own")
    if (metric.kind == AUTOMATIC) != (metric.compute is not None):
        raise ValueError(f"metric {metric.name!r}: an automatic metric computes, feedback doesn't")
    if metric.direction not in (-1, 1) or not metric.lo < metric.hi or metric.role == PRIMARY:
        raise ValueError(f"metric {metric.name!r}: direction +1 or -1, lo < hi, not primary")
    _registry[metric.name] = metric
    return metric


def registry() -> dict[str, Metric]:
    """Every metric, the built-in ones first, then those of installed entry points (loaded once:
    each entry point is a callable that registers its metrics)."""
    global _loaded
    if not _loaded:
        _loaded = True
        from importlib.metadata import entry_points

        for ep in entry_points(group=ENTRY_POINTS):
            ep.load()()
    return _registry


def get(name: Any, param: str = "metric") -> Metric:
    """The metric called ``name``; :class:`MetricError` naming ``param`` when there is none."""
    reg = registry()
    if not isinstance(name, str) or name not in reg:
        raise MetricError(f"{param}: not a metric; one of {', '.join(reg)}", param)
    return reg[name]


def feedback_metric(name: Any) -> Metric:
    """The metric a feedback request scores; automatic ones are refused (the server measures
    them on every reply: a client's value would be a second, different one)."""
    m = get(name)
    if m.kind == PAIRED:
        raise MetricError(f"metric: {m.name} judges a pair: POST /v1/steering/preference", "metric")
    if m.kind != FEEDBACK:
        raise MetricError(f"metric: {m.name} is measured by the server, not posted", "metric")
    return m


def posted_metric(name: Any) -> Metric:
    """The metric a feedback or preference names: a feedback metric, or the paired one."""
    m = get(name)
    if m.kind == AUTOMATIC:
        raise MetricError(f"metric: {m.name} is measured by the server, not posted", "metric")
    return m


def posted() -> tuple[list[str], float, float]:
    """The feedback metrics' names and the range that holds all their values: what the
    feedback request's schema publishes (each metric's own range is checked on top)."""
    rows = [m for m in registry().values() if m.kind == FEEDBACK]
    return [m.name for m in rows], min(m.lo for m in rows), max(m.hi for m in rows)


def automatic(rec: Mapping[str, Any]) -> dict[str, float]:
    """The automatic metrics' values of one decision record (those it can measure)."""
    out = {}
    for m in registry().values():
        if m.compute is not None and (v := m.compute(rec)) is not None:
            out[m.name] = v
    return out
