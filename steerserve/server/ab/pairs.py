"""Paired preferences (A better, B better, tie: -1, +1, 0) of one A/B request's answers, tested at
the subject as one sample against no preference."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from steerserve.server.ab import metrics as ab_metrics
from steerserve.server.ab import stats as ab_stats
from steerserve.server.ab.records import Row

SIGN_TEST_NOTE = (
    "exact sign test of the pairs judged without a tie, each pair its own: valid only when read "
    "once, at a number of pairs planned in advance"
)
#: The pair's answers as the preference names them.
BETTER = {1: "B (steered)", -1: "A (unsteered)"}


def pairs_report(rows: Sequence[Row], min_n: int, alpha: float) -> dict[str, Any]:
    """Per experiment and treatment (the steered answer, in words), the preference overall and
    per language."""
    out: dict[str, Any] = {}
    by_exp: dict[str, dict[str, list[Row]]] = {}
    for r in rows:
        by_exp.setdefault(r.experiment or "", {}).setdefault(r.treatment or "?", []).append(r)
    m = ab_metrics.get(ab_metrics.PREFERENCE)
    for name in sorted(by_exp):
        treatments = by_exp[name]
        groups = sum(1 + len({r.language or "unknown" for r in rs}) for rs in treatments.values())
        each = ab_stats.family_alpha(alpha, groups)
        out[name] = {
            "metric": m.name,
            "family": {"method": "Bonferroni", "alpha": alpha, "size": groups, "each": each},
            "treatments": {
                t: {
                    "overall": preference(rs, each, min_n, m),
                    "per_language": {
                        lang: preference([r for r in rs if (r.language or "unknown") == lang],
                                         each, min_n, m)
                        for lang in sorted({r.language or "unknown" for r in rs})
                    },
                }
                for t, rs in sorted(treatments.items())
            },
        }  # fmt: skip
    return out


def preference(rows: Sequence[Row], alpha: float, min_n: int, m: ab_metrics.Metric) -> dict:
    """One group's pairs: counts, the mean preference per subject with its always-valid
    interval, the call, the sample still needed, and the sign test."""
    judged = [r for r in rows if ab_metrics.PREFERENCE in r.values]
    x = np.array([r.values[ab_metrics.PREFERENCE] for r in judged], dtype=float)
    ids = [r.subject_hash if r.subject_hash is not None else f"\x00{r.id}" for r in judged]
    subj = np.unique(np.asarray(ids, dtype=object).astype(str), return_inverse=True)[1]
    out: dict[str, Any] = {
        "pairs": len(rows),
        "judged": len(judged),
        "subjects": len(set(ids)),
        "b": int((x > 0).sum()),
        "a": int((x < 0).sum()),
        "tie": int((x == 0).sum()),
        "mean": None,
        "ci": None,
        "p_value": None,
        "alpha": alpha,
        "better": None,
        "needed": None,
        "method": f"always-valid (mSPRT, normal mixture, tau = {m.tau:g}), one sample "
        "against 0, subject level",
    }
    out["sign_test"] = _sign_test(out["b"], out["a"])
    if not judged:
        out["status"], out["verdict"] = "missing", "no pair judged yet"
        return out
    mo = ab_stats.moments(subj.reshape(-1), x)
    d, h, p = (float(v) for v in ab_stats.one_sample(mo, m.lo, m.hi, alpha, m.tau**2))
    enough = len(judged) >= min_n and out["subjects"] >= 2
    if math.isfinite(h):
        out |= {"mean": d, "ci": [d - h, d + h], "p_value": p}
    sign = int(ab_stats.decide(d, h, enough))
    out["better"] = BETTER.get(sign)
    if not enough:
        out["status"] = "too few"
        out["verdict"] = (
            f"too few judged pairs to call (need {min_n} and 2 subjects; {len(judged)} judged)"
        )
    else:
        why = f"mean {d:+.3g} [{d - h:.3g}, {d + h:.3g}] always-valid at {alpha:.2g}"
        out["status"] = "called" if sign else "open"
        out["verdict"] = f"{out['better']} preferred: {why}" if sign else f"no preference: {why}"
    if not sign and mo.n >= 2:
        k = ab_stats.scale_needed(float(_var(mo, m)), m.effect, alpha, m.tau**2)
        if math.isfinite(k):
            more = max(k - 1.0, 0.0)
            out["needed"] = {
                "effect": m.effect,
                "subjects": math.ceil(more * float(mo.n)),
                "pairs": max(math.ceil(more * float(mo.c)), min_n - len(judged)),
            }
    return out


def _var(mo: ab_stats.Moments, m: ab_metrics.Metric) -> float:
    return float(ab_stats.ratio(mo, m.lo, m.hi, center=0.0)[1])


def _sign_test(b: int, a: int) -> dict[str, Any]:
    from scipy.stats import binomtest

    n = a + b
    p = float(binomtest(b, n, 0.5).pvalue) if n else None
    return {"b": b, "a": a, "p_value": p, "note": SIGN_TEST_NOTE}
