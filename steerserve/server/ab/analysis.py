"""``steerserve ab-report LOG|STORE``: who won a server-side A/B experiment, read from its decision
log or its experiment store; the numbers ``/experiments`` shows.

Per experiment, for every metric of the registry (``metrics.py``) that has values, overall and
per detected language: each arm's mean at the unit of randomisation (the subject), the steered -
unsteered difference with its always-valid interval (an mSPRT confidence sequence,
:mod:`steerserve.server.ab.stats`), what it calls, and the sample still needed for the metric's
stated effect. The intervals are corrected for the family of every metric and language of the
experiment (Bonferroni), so reading every verdict at every refresh calls a false winner with
probability at most 5 %. The winner is called on the primary metric and withheld when the winning
arm is worse on a guardrail. Languages where the steered arm was not applied (``auto`` left the
prompts unsteered) are shown as such and left out of the overall comparison. The fixed-horizon
numbers stay as a labelled second view.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from steerserve.server.ab import metrics as ab_metrics
from steerserve.server.ab import stats as ab_stats
from steerserve.server.ab.experiment import STEERED, UNSTEERED
from steerserve.server.ab.records import Ignored, Row, read_log, scan_log, scan_records
from steerserve.server.ab.rendering import (
    FORMATS,
    diff_text,
    ignored_note,
    render,
    report_markdown,
    srm_line,
    srm_warning,
    store_line,
    write_report,
)

if TYPE_CHECKING:
    from steerserve.server.ab.store import Store

__all__ = [
    "FORMATS",
    "Ignored",
    "Row",
    "build_report",
    "ignored_note",
    "read_log",
    "render",
    "report",
    "report_markdown",
    "scan_log",
    "store_line",
    "write_report",
]

#: Fewer values than this in either arm: no verdict on that metric. Fixed by the server (the
#: page's viewers cannot lower it): the always-valid test needs no planned sample size, but a
#: winner on five thumbs convinces nobody.
MIN_SCORED = 30
Z95 = 1.959964
#: The family's level: the chance that any verdict of the experiment, at any look, is false.
ALPHA = ab_stats.ALPHA
FAMILY_METHOD = "Bonferroni"
#: What the fixed-horizon view is good for, said wherever it is shown.
FIXED_HORIZON_NOTE = (
    "normal approximation on the same subject-level variance, uncorrected: valid only when read "
    "once, at a sample size planned in advance; read again and again (the live page refreshes "
    "every 2 s) it calls false winners far more often than 5 %"
)
#: Points of the primary metric's confidence sequence over time the report keeps.
SEQUENCE_POINTS = 60
#: The ``splits`` key of a split that holds for every experiment (``ab-report --split``).
EVERY = "*"
ARMS = (STEERED, UNSTEERED)


@dataclass
class Frame:
    """One experiment's rows as arrays, in the order they were answered."""

    rows: list[Row]
    steered: NDArray[np.bool_]
    subjects: NDArray[np.int64]
    language: NDArray[np.str_]
    by_subject: bool  # every row names its subject (else a row without one is its own)

    @classmethod
    def of(cls, rows: Sequence[Row]) -> Frame:
        order = sorted(range(len(rows)), key=lambda i: _when(rows[i], i))
        rows = [rows[i] for i in order]
        ids = [r.subject_hash if r.subject_hash is not None else f"\x00{r.id}" for r in rows]
        subjects = np.unique(np.asarray(ids, dtype=object).astype(str), return_inverse=True)[1]
        return cls(
            rows,
            np.array([r.arm == STEERED for r in rows], dtype=bool),
            subjects.reshape(-1),
            np.array([r.language or "unknown" for r in rows], dtype=str),
            all(r.subject_hash is not None for r in rows),
        )

    def values(self, metric: str) -> NDArray[np.float64]:
        return np.array([r.values.get(metric, np.nan) for r in self.rows], dtype=float)


def _when(r: Row, i: int) -> tuple[bool, float, Any]:
    """Time order (a log and a store of the same records agree); rows without a time as given."""
    return (r.ts is None, r.ts or 0.0, r.id if r.ts is not None else i)


def _metric(
    f: Frame, mask: NDArray[np.bool_], m: ab_metrics.Metric, alpha: float, min_n: int
) -> dict[str, Any]:
    """One metric in one group: each arm at the subject level, the always-valid difference at
    the family's level, what it calls, and what is still needed for the metric's effect."""
    x = f.values(m.name)
    a = ab_stats.moments(f.subjects, np.where(mask & f.steered, x, np.nan))
    b = ab_stats.moments(f.subjects, np.where(mask & ~f.steered, x, np.nan))
    tau2 = m.tau**2
    d, h, p = (
        float(v) for v in ab_stats.always_valid_arrays(a, b, m.lo, m.hi, alpha, tau2, m.relative)
    )
    fd, fh, fp = (float(v) for v in ab_stats.fixed_horizon(a, b, m.lo, m.hi, m.relative))
    n = {STEERED: int(a.c), UNSTEERED: int(b.c)}
    subjects = {STEERED: int(a.n), UNSTEERED: int(b.n)}
    means = {
        arm: _num(ab_stats.ratio(mo, m.lo, m.hi)[0]) for arm, mo in zip(ARMS, (a, b), strict=True)
    }
    enough = min(n.values()) >= min_n and min(subjects.values()) >= 2
    sign = int(ab_stats.decide(d, h, enough))
    better = None if sign == 0 else STEERED if sign * m.direction > 0 else UNSTEERED
    ok = math.isfinite(h)
    out: dict[str, Any] = {
        "metric": m.name,
        "role": m.role,
        "n": n,
        "subjects": subjects,
        "mean": means,
        "difference": {
            "diff": _num(d),
            "ci": [d - h, d + h] if ok else None,
            "p_value": _num(p) if ok else None,
            "alpha": alpha,
            "relative": m.relative,
            "method": f"always-valid (mSPRT, normal mixture, tau = {m.tau:g}), subject level",
        },
        "fixed_horizon": {
            "diff": _num(fd),
            "ci95": [fd - fh, fd + fh] if math.isfinite(fh) else None,
            "p_value": _num(fp),
            "note": FIXED_HORIZON_NOTE,
        },
        "better": better,
        "harm": m.role == ab_metrics.GUARDRAIL and better == UNSTEERED,
        "status": _status(n, enough, better),
        "needed": _needed(a, b, m, alpha, min_n) if better is None else None,
    }
    out["verdict"] = metric_verdict(out, min_n)
    return out


def _status(n: Mapping[str, int], enough: bool, better: str | None) -> str:
    if not any(n.values()):
        return "missing"
    if not enough:
        return "too few"
    return "called" if better else "open"


def _needed(
    a: ab_stats.Moments, b: ab_stats.Moments, m: ab_metrics.Metric, alpha: float, min_n: int
) -> dict[str, Any] | None:
    """About how many more subjects (and values) both arms together need, at the current split
    and values per subject, before a true difference of the metric's ``effect`` would be called;
    None when there are too few subjects to estimate a variance."""
    if min(a.n, b.n) < 2:
        return None
    _, v = ab_stats.difference(a, b, m.lo, m.hi, m.relative)
    k = ab_stats.scale_needed(float(v), m.effect, alpha, m.tau**2)
    if not math.isfinite(k):
        return None
    more = max(k - 1.0, 0.0)
    values = math.ceil(more * float(a.c + b.c))
    floor = max(min_n - int(a.c), 0) + max(min_n - int(b.c), 0)
    per_subject = float(a.n + b.n) / float(a.c + b.c)
    return {
        "effect": m.effect,
        "subjects": max(math.ceil(more * float(a.n + b.n)), math.ceil(floor * per_subject)),
        "values": max(values, floor),
    }


def metric_verdict(r: Mapping[str, Any], min_n: int) -> str:
    """One metric's result in words."""
    n, d = r["n"], r["difference"]
    if r["status"] == "missing":
        return "no values here"
    if r["status"] == "too few":
        return (
            f"too few values to call (need {min_n} per arm and 2 subjects; steered "
            f"{n[STEERED]}, unsteered {n[UNSTEERED]})"
        )
    why = f"{diff_text(d)} always-valid at {d['alpha']:.2g}"
    if r["better"] is None:
        return f"no significant difference: {why}"
    return f"{r['better']} better: {why}" + (" (guardrail harmed)" if r["harm"] else "")


def _num(x: Any) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def mean_ci(values: Sequence[float]) -> dict[str, Any]:
    """Mean and normal-approximation 95 % CI per reply (None where n < 2): a description of an
    arm, not a test."""
    n = len(values)
    if n == 0:
        return {"n": 0, "mean": None, "ci95": None}
    x = np.asarray(values, dtype=float)
    m = float(x.mean())
    if n < 2:
        return {"n": n, "mean": m, "ci95": None}
    half = Z95 * float(x.std(ddof=1)) / math.sqrt(n)
    return {"n": n, "mean": m, "ci95": [m - half, m + half]}


def _arm_stats(f: Frame, mask: NDArray[np.bool_]) -> dict[str, Any]:
    rows = [r for r, keep in zip(f.rows, mask, strict=True) if keep]
    lat = [r.latency_ms for r in rows if r.latency_ms is not None]
    return {
        "requests": len(rows),
        "subjects": len(set(f.subjects[mask].tolist())),
        "applied": sum(r.applied is True for r in rows),
        "score": mean_ci([r.score for r in rows if r.score is not None]),
        "latency_ms": {
            "p50": float(np.percentile(lat, 50)) if lat else None,
            "p95": float(np.percentile(lat, 95)) if lat else None,
        },
    }


def _verdict(results: Mapping[str, Any], primary: str, min_n: int) -> tuple[str | None, str]:
    """(winner, the sentence): the primary metric's call, withheld when the better arm is worse
    on a guardrail."""
    r = results.get(primary)
    if r is None or r["status"] == "missing":
        return None, f"no {primary} values yet: no winner"
    if r["status"] == "too few":
        n = r["n"]
        what = "scored replies" if primary == ab_metrics.FEEDBACK else f"{primary} values"
        return None, (
            f"too few {what} to call a winner (need {min_n} per arm; steered "
            f"{n[STEERED]}, unsteered {n[UNSTEERED]})"
        )
    why = f"{diff_text(r['difference'])} always-valid at {r['difference']['alpha']:.2g}"
    better = r["better"]
    if better is None:
        return None, f"no significant difference on {primary}: {why}"
    worse = [
        name
        for name, g in results.items()
        if g["role"] == ab_metrics.GUARDRAIL and g["better"] not in (None, better)
    ]
    if worse:
        return None, (
            f"{better} is better on {primary} ({why}) but worse on the guardrail "
            f"{', '.join(worse)}: no winner"
        )
    return better, f"{better} wins on {primary}: {why}"


def _group(
    f: Frame,
    mask: NDArray[np.bool_],
    present: Sequence[ab_metrics.Metric],
    primary: str,
    alpha: float,
    min_n: int,
) -> dict[str, Any]:
    results = {m.name: _metric(f, mask, m, alpha, min_n) for m in present}
    winner, verdict = _verdict(results, primary, min_n)
    empty = {"diff": None, "ci": None, "p_value": None}
    p = results.get(primary, {})
    return {
        "arms": {arm: _arm_stats(f, mask & (f.steered == (arm == STEERED))) for arm in ARMS},
        "applied": applied_status(f, mask),
        "metrics": results,
        "primary": primary,
        "difference": p.get("difference", empty),
        "fixed_horizon": p.get("fixed_horizon", {**empty, "note": FIXED_HORIZON_NOTE}),
        "verdict": verdict,
        "winner": winner,
    }


def applied_status(f: Frame, mask: NDArray[np.bool_]) -> dict[str, Any]:
    """Whether the steered arm's steering was applied to the group's steered requests (``auto``
    leaves a language it does not steer unsteered: those requests are no steered evidence)."""
    flags = [r.applied for r, keep in zip(f.rows, mask & f.steered, strict=True) if keep]
    done = sum(x is True for x in flags)
    if not flags:
        status = "no steered requests"
    elif any(x is None for x in flags):
        status = "unknown"  # a log from before the flag was recorded
    else:
        status = "applied" if done == len(flags) else "not applied" if done == 0 else "partly"
    return {"steered_requests": len(flags), "applied": done, "status": status}


def _sequence(f: Frame, mask: NDArray[np.bool_], m: ab_metrics.Metric, alpha: float) -> dict:
    """The primary metric's confidence sequence over time (at most :data:`SEQUENCE_POINTS`
    looks, from the first with 2 subjects in each arm): what the page draws."""
    x = f.values(m.name)
    a = ab_stats.running_moments(f.subjects, np.where(mask & f.steered, x, np.nan))
    b = ab_stats.running_moments(f.subjects, np.where(mask & ~f.steered, x, np.nan))
    looks = np.flatnonzero((a.n >= 2) & (b.n >= 2) & mask & ~np.isnan(x))
    out: dict[str, Any] = {"metric": m.name, "alpha": alpha, "relative": m.relative}
    out |= {k: [] for k in ("ts", "values", "diff", "lo", "hi")}
    if looks.size == 0:
        return out
    at = looks[np.unique(np.linspace(0, looks.size - 1, SEQUENCE_POINTS).round().astype(int))]
    pick = ab_stats.Moments(*(v[at] for v in a)), ab_stats.Moments(*(v[at] for v in b))
    d, h, _ = ab_stats.always_valid_arrays(*pick, m.lo, m.hi, alpha, m.tau**2, m.relative)
    out["ts"] = [f.rows[i].ts for i in at]
    out["values"] = (pick[0].c + pick[1].c).astype(int).tolist()
    out["diff"], out["lo"], out["hi"] = d.tolist(), (d - h).tolist(), (d + h).tolist()
    return out


def experiment_report(
    rows: Sequence[Row], min_n: int, split: float | None, primary: str | None = None
) -> dict[str, Any]:
    """One experiment: overall (the languages where the steered arm was applied), per language,
    the family's correction, the primary metric's sequence, the sample-ratio check."""
    f = Frame.of(rows)
    langs = sorted(set(f.language.tolist()))
    masks = {lang: f.language == lang for lang in langs}
    status = {lang: applied_status(f, masks[lang])["status"] for lang in langs}
    left_out = [lang for lang in langs if status[lang] == "not applied"]
    overall = (
        ~np.isin(f.language, left_out) if len(left_out) < len(langs) else np.ones_like(f.steered)
    )
    present = [m for m in ab_metrics.registry().values() if not np.isnan(f.values(m.name)).all()]
    names = [m.name for m in present]
    primary = primary or (
        ab_metrics.FEEDBACK if "feedback" in names else ab_metrics.PRIMARY_FALLBACK
    )
    groups = {mask.tobytes() for mask in (overall, *masks.values())}
    size = max(len(present) * len(groups), 1)
    alpha = ab_stats.family_alpha(ALPHA, size)
    out = {
        "overall": _group(f, overall, present, primary, alpha, min_n),
        "per_language": {
            lang: _group(f, masks[lang], present, primary, alpha, min_n) for lang in langs
        },
        "primary": primary,
        "not_applied": left_out,
        "unit": "subjects" if f.by_subject else "requests (no subject hashes in this log)",
        "family": {
            "method": FAMILY_METHOD,
            "alpha": ALPHA,
            "size": size,
            "each": alpha,
            "metrics": names,
            "groups": len(groups),
        },
        "srm": sample_ratio(rows, split),
    }
    if primary in names:
        m = ab_metrics.get(primary)
        out["sequence"] = _sequence(f, overall, m, alpha)
    for lang in left_out:
        g = out["per_language"][lang]
        g["verdict"] = (
            f"steered arm not applied here (its prompts were answered unsteered): {g['verdict']}"
        )
    return out


def sample_ratio(rows: Sequence[Row], split: float | None) -> dict[str, Any]:
    """The sample-ratio-mismatch check of one experiment's rows against ``split`` (the share of
    subjects steered; None: not known, nothing tested). It counts distinct subjects per arm, the
    unit the split assigns (a heavy user's requests all land in one arm, so request counts would
    flag healthy splits); a log without subject hashes falls back to requests."""
    requests = {arm: sum(r.arm == arm for r in rows) for arm in ARMS}
    by_subject = all(r.subject_hash is not None for r in rows)
    if by_subject:
        seen = {arm: {r.subject_hash for r in rows if r.arm == arm} for arm in ARMS}
        counts = {arm: len(x) for arm, x in seen.items()}
        both = len(seen[STEERED] & seen[UNSTEERED])
    else:
        counts, both = dict(requests), None
    out: dict[str, Any] = {
        "unit": "subjects" if by_subject else "requests",
        "counts": counts,
        "requests": requests,
        "subjects_in_both_arms": both,  # the sticky split moved someone: a changed split?
        "split": split,
        "observed_share": None,
        "p_value": None,
        "alpha": ab_stats.SRM_ALPHA,
        "checked": False,
        "flagged": False,
    }
    if split is None:
        out["note"] = (
            "not checked: the split is not in the log (the server's /experiments report checks it)"
        )
    else:
        check = ab_stats.srm(counts[STEERED], counts[UNSTEERED], split, unit=out["unit"])
        out.update({k: check[k] for k in ("observed_share", "p_value", "checked", "flagged")})
        if not check["checked"]:
            out["note"] = "not checked: too few to test"
    # The words, here once: the markdown report and the live page both show these.
    out["summary"], out["warning"] = srm_line(out), srm_warning(out)
    return out


def build_report(
    rows: Sequence[Row],
    min_n: int = MIN_SCORED,
    ignored: Ignored | None = None,
    splits: Mapping[str, float] | None = None,
    store: Mapping[str, Any] | None = None,
    primary: str | None = None,
) -> dict[str, Any]:
    """The report of every experiment in ``rows`` (``ignored``: the log's lines it does not
    stand on, said in the report; ``splits``: the share of subjects steered by experiment name,
    :data:`EVERY` for any, for the sample-ratio check; ``store``: an experiment store's own
    account of its replicas; ``primary``: the metric the winner is called on, else feedback
    where the experiment has any, else ``language_match``)."""
    ignored = ignored or Ignored()
    splits = splits or {}
    enrolled = [r for r in rows if r.experiment and r.arm in ARMS]
    out: dict[str, Any] = {
        "requests": len(rows),
        "skipped_lines": ignored.total,
        "unreadable_lines": ignored.unreadable,
        "orphan_feedback_lines": ignored.orphan_feedback,
        "unknown_metric_lines": ignored.unknown_metric,
        "not_enrolled": len(rows) - len(enrolled),
        "min_scored_per_arm": min_n,
        "alpha": ALPHA,
        "metrics": [m.describe() for m in ab_metrics.registry().values()],
        "experiments": {},
    }
    if store is not None:
        out["store"] = dict(store)
    by_name: dict[str, list[Row]] = {}
    for r in enrolled:
        by_name.setdefault(r.experiment, []).append(r)  # type: ignore[arg-type]
    for name in sorted(by_name):
        split = splits.get(name, splits.get(EVERY))
        out["experiments"][name] = experiment_report(by_name[name], min_n, split, primary)
    return out


def report(
    source: str | Path | Store,
    min_n: int = MIN_SCORED,
    splits: Mapping[str, float] | None = None,
    primary: str | None = None,
) -> dict[str, Any]:
    """The report of a decision log (a path) or an experiment store (its URL, or the server's
    open store): what ``steerserve ab-report`` prints and the server's ``/experiments`` page
    shows (one code path for both). ValueError: a store URL that cannot be read."""
    from steerserve.server.ab import store as ab_store

    if isinstance(source, ab_store.Store):
        rows, ignored = scan_records(source.records())
        return build_report(rows, min_n, ignored, splits, store=source.status(), primary=primary)
    if ab_store.is_store_url(source):
        with ab_store.open_store(str(source), migrate=False) as store:
            return report(store, min_n, splits, primary)
    rows, ignored = scan_log(source)
    return build_report(rows, min_n, ignored, splits, primary=primary)
