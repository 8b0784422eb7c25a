"""One phase of an experiment, analysed: every treatment against the control, per metric and per
group (``all`` and each detected language), at the unit of randomisation, always valid, at the
family's level (``analysis.py`` sets it: every treatment x metric x group of the phase), and the
sample-ratio check against the phase's recorded allocation.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from steerserve.server.ab import metrics as ab_metrics
from steerserve.server.ab import stats as ab_stats
from steerserve.server.ab.records import Row
from steerserve.server.ab.rendering import diff_text, srm_line, srm_warning

Z95 = 1.959964
#: What the fixed-horizon view is good for, said wherever it is shown.
FIXED_HORIZON_NOTE = (
    "normal approximation on the same subject-level variance, uncorrected: valid only when read "
    "once, at a sample size planned in advance; read again and again (the live page refreshes "
    "every 2 s) it calls false winners far more often than 5 %"
)
#: Points of the primary metric's confidence sequence over time the report keeps.
SEQUENCE_POINTS = 60


@dataclass
class Frame:
    """One phase's rows as arrays, in the order they were answered; ``arm`` indexes ``arms``
    (-1: a row of an arm this phase does not have)."""

    rows: list[Row]
    arms: tuple[str, ...]
    arm: NDArray[np.int64]
    subjects: NDArray[np.int64]
    language: NDArray[np.str_]
    by_subject: bool  # every row names its subject (else a row without one is its own)

    @classmethod
    def of(cls, rows: Sequence[Row], arms: Sequence[str]) -> Frame:
        order = sorted(range(len(rows)), key=lambda i: _when(rows[i], i))
        rows = [rows[i] for i in order]
        ids = [r.subject_hash if r.subject_hash is not None else f"\x00{r.id}" for r in rows]
        subjects = np.unique(np.asarray(ids, dtype=object).astype(str), return_inverse=True)[1]
        index = {a: i for i, a in enumerate(arms)}
        return cls(
            rows,
            tuple(arms),
            np.array([index.get(r.arm or "", -1) for r in rows], dtype=np.int64),
            subjects.reshape(-1),
            np.array([r.language or "unknown" for r in rows], dtype=str),
            all(r.subject_hash is not None for r in rows),
        )

    def values(self, metric: str) -> NDArray[np.float64]:
        return np.array([r.values.get(metric, np.nan) for r in self.rows], dtype=float)

    def of_arm(self, arm: str) -> NDArray[np.bool_]:
        return self.arm == self.arms.index(arm)


def _when(r: Row, i: int) -> tuple[bool, float, Any]:
    """Time order (a log and a store of the same records agree); rows without a time as given."""
    return (r.ts is None, r.ts or 0.0, r.id if r.ts is not None else i)


def _num(x: Any) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def metric(
    f: Frame,
    mask: NDArray[np.bool_],
    m: ab_metrics.Metric,
    alpha: float,
    min_n: int,
    arms: tuple[str, str],
) -> dict[str, Any]:
    """One metric in one group, ``arms`` (treatment, control): each arm at the subject level,
    the always-valid difference at the family's level, what it calls, and what is still needed
    for the metric's effect."""
    treat, control = arms
    x = f.values(m.name)
    a = ab_stats.moments(f.subjects, np.where(mask & f.of_arm(treat), x, np.nan))
    b = ab_stats.moments(f.subjects, np.where(mask & f.of_arm(control), x, np.nan))
    tau2 = m.tau**2
    d, h, p = (
        float(v) for v in ab_stats.always_valid_arrays(a, b, m.lo, m.hi, alpha, tau2, m.relative)
    )
    fd, fh, fp = (float(v) for v in ab_stats.fixed_horizon(a, b, m.lo, m.hi, m.relative))
    n = {treat: int(a.c), control: int(b.c)}
    subjects = {treat: int(a.n), control: int(b.n)}
    means = {
        arm: _num(ab_stats.ratio(mo, m.lo, m.hi)[0]) for arm, mo in zip(arms, (a, b), strict=True)
    }
    enough = min(n.values()) >= min_n and min(subjects.values()) >= 2
    sign = int(ab_stats.decide(d, h, enough))
    better = None if sign == 0 else treat if sign * m.direction > 0 else control
    ok = math.isfinite(h)
    out: dict[str, Any] = {
        "metric": m.name,
        "role": m.role,
        "arms": list(arms),
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
        "harm": m.role == ab_metrics.GUARDRAIL and better == control,
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


def _counts(n: Mapping[str, int]) -> str:
    return ", ".join(f"{arm} {k}" for arm, k in n.items())


def metric_verdict(r: Mapping[str, Any], min_n: int) -> str:
    """One metric's result in words."""
    n, d = r["n"], r["difference"]
    if r["status"] == "missing":
        return "no values here"
    if r["status"] == "too few":
        return f"too few values to call (need {min_n} per arm and 2 subjects; {_counts(n)})"
    why = f"{diff_text(d)} always-valid at {d['alpha']:.2g}"
    if r["better"] is None:
        return f"no significant difference: {why}"
    return f"{r['better']} better: {why}" + (" (guardrail harmed)" if r["harm"] else "")


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


def arm_stats(f: Frame, mask: NDArray[np.bool_]) -> dict[str, Any]:
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


def verdict(
    results: Mapping[str, Any], primary: str, min_n: int, arms: tuple[str, str]
) -> tuple[str | None, str]:
    """(winner, the sentence) of one treatment against the control: the primary metric's call,
    withheld when the better arm is worse on a guardrail."""
    r = results.get(primary)
    if r is None or r["status"] == "missing":
        return None, f"no {primary} values yet: no winner"
    if r["status"] == "too few":
        what = "scored replies" if primary == ab_metrics.FEEDBACK else f"{primary} values"
        return None, (f"too few {what} to call a winner (need {min_n} per arm; {_counts(r['n'])})")
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


def applied_status(f: Frame, mask: NDArray[np.bool_], treat: str) -> dict[str, Any]:
    """Whether the treatment's steering was applied to its requests of the group (``auto``
    leaves a language it does not steer unsteered: those requests are no steered evidence)."""
    keep = mask & f.of_arm(treat)
    flags = [r.applied for r, k in zip(f.rows, keep, strict=True) if k]
    done = sum(x is True for x in flags)
    if not flags:
        status = "no steered requests"
    elif any(x is None for x in flags):
        status = "unknown"  # a log from before the flag was recorded
    else:
        status = "applied" if done == len(flags) else "not applied" if done == 0 else "partly"
    return {"steered_requests": len(flags), "applied": done, "status": status}


def group(
    f: Frame,
    masks: Mapping[str, NDArray[np.bool_]],
    present: Sequence[ab_metrics.Metric],
    primary: str,
    alpha: float,
    min_n: int,
    control: str,
) -> dict[str, Any]:
    """One group: each arm described, each treatment (``masks``: the rows it is compared on)
    against the control, and the group's call over all of them."""
    comparisons = {}
    for treat, mask in masks.items():
        pair = (treat, control)
        results = {m.name: metric(f, mask, m, alpha, min_n, pair) for m in present}
        winner, words = verdict(results, primary, min_n, pair)
        empty = {"diff": None, "ci": None, "p_value": None}
        p = results.get(primary, {})
        comparisons[treat] = {
            "treatment": treat,
            "control": control,
            "applied": applied_status(f, mask, treat),
            "metrics": results,
            "difference": p.get("difference", empty),
            "fixed_horizon": p.get("fixed_horizon", {**empty, "note": FIXED_HORIZON_NOTE}),
            "verdict": words,
            "winner": winner,
        }
    union = np.zeros(len(f.rows), dtype=bool)
    for mask in masks.values():
        union |= mask
    winner, words = overall_call(comparisons, control)
    first = next(iter(comparisons.values()))
    return {
        "arms": {arm: arm_stats(f, union & f.of_arm(arm)) for arm in f.arms},
        "applied": first["applied"],
        "comparisons": comparisons,
        "metrics": first["metrics"],
        "primary": primary,
        "difference": first["difference"],
        "fixed_horizon": first["fixed_horizon"],
        "verdict": words,
        "winner": winner,
    }


def overall_call(comparisons: Mapping[str, Any], control: str) -> tuple[str | None, str]:
    """The group's winner over every treatment: the one treatment that beats the control (two
    or more: none, as they were not compared with each other), the control where it beats
    every treatment, else none."""
    if len(comparisons) == 1:
        (c,) = comparisons.values()
        return c["winner"], c["verdict"]
    beat = [t for t, c in comparisons.items() if c["winner"] == t]
    lost = [t for t, c in comparisons.items() if c["winner"] == control]
    each = "; ".join(f"{t}: {c['verdict']}" for t, c in comparisons.items())
    if len(beat) == 1:
        return beat[0], f"{beat[0]} wins against {control} ({each})"
    if beat:
        return None, (
            f"{' and '.join(beat)} each beat {control}, but were not compared with each other: "
            f"no single winner ({each})"
        )
    if len(lost) == len(comparisons):
        return control, f"{control} beats every treatment ({each})"
    return None, each


def sequence(
    f: Frame, mask: NDArray[np.bool_], m: ab_metrics.Metric, alpha: float, arms: tuple[str, str]
) -> dict[str, Any]:
    """The primary metric's confidence sequence over time, ``arms`` (treatment, control): at
    most :data:`SEQUENCE_POINTS` looks, from the first with 2 subjects in each arm (what the
    page draws)."""
    x = f.values(m.name)
    a = ab_stats.running_moments(f.subjects, np.where(mask & f.of_arm(arms[0]), x, np.nan))
    b = ab_stats.running_moments(f.subjects, np.where(mask & f.of_arm(arms[1]), x, np.nan))
    both = mask & (f.of_arm(arms[0]) | f.of_arm(arms[1]))
    looks = np.flatnonzero((a.n >= 2) & (b.n >= 2) & both & ~np.isnan(x))
    out: dict[str, Any] = {"metric": m.name, "alpha": alpha, "relative": m.relative}
    out |= {"arms": list(arms)} | {k: [] for k in ("ts", "values", "diff", "lo", "hi")}
    if looks.size == 0:
        return out
    at = looks[np.unique(np.linspace(0, looks.size - 1, SEQUENCE_POINTS).round().astype(int))]
    pick = ab_stats.Moments(*(v[at] for v in a)), ab_stats.Moments(*(v[at] for v in b))
    d, h, _ = ab_stats.always_valid_arrays(*pick, m.lo, m.hi, alpha, m.tau**2, m.relative)
    out["ts"] = [f.rows[i].ts for i in at]
    out["values"] = (pick[0].c + pick[1].c).astype(int).tolist()
    out["diff"], out["lo"], out["hi"] = d.tolist(), (d - h).tolist(), (d + h).tolist()
    return out


def sample_ratio(
    rows: Sequence[Row],
    arms: Sequence[str],
    control: str,
    allocation: Mapping[str, float] | None,
) -> dict[str, Any]:
    """The sample-ratio-mismatch check of one phase's rows against its allocation (None: not
    known, nothing tested). It counts distinct subjects per arm, the unit the allocation
    assigns (a heavy user's requests all land in one arm, so request counts would flag healthy
    splits); a log without subject hashes falls back to requests."""
    requests = {arm: sum(r.arm == arm for r in rows) for arm in arms}
    by_subject = all(r.subject_hash is not None for r in rows)
    if by_subject:
        seen = {arm: {r.subject_hash for r in rows if r.arm == arm} for arm in arms}
        counts = {arm: len(x) for arm, x in seen.items()}
        every = [h for x in seen.values() for h in x]
        both: int | None = len(every) - len(set(every))
    else:
        counts, both = dict(requests), None
    two = len(arms) == 2
    treat = next((a for a in arms if a != control), control)
    out: dict[str, Any] = {
        "unit": "subjects" if by_subject else "requests",
        "counts": counts,
        "requests": requests,
        "subjects_in_both_arms": both,  # the sticky split moved someone: a changed split?
        "arms": list(arms),
        "control": control,
        "allocation": None if allocation is None else dict(allocation),
        "split": None if allocation is None or not two else allocation.get(treat, 0.0),
        "observed_share": None,
        "p_value": None,
        "alpha": ab_stats.SRM_ALPHA,
        "checked": False,
        "flagged": False,
    }
    if allocation is None:
        out["note"] = "not checked: the allocation is not recorded (give ab-report --split)"
    else:
        check = ab_stats.srm_arms([counts[a] for a in arms], [allocation.get(a, 0.0) for a in arms],
                                  unit=out["unit"])  # fmt: skip
        total = sum(counts.values())
        out["observed_share"] = None if not total else {a: counts[a] / total for a in arms}
        if two and total:
            out["observed_share"] = counts[treat] / total
        out.update({k: check[k] for k in ("p_value", "checked", "flagged")})
        if not check["checked"]:
            out["note"] = "not checked: too few to test"
    # The words, here once: the markdown report and the live page both show these.
    out["summary"], out["warning"] = srm_line(out), srm_warning(out)
    return out
