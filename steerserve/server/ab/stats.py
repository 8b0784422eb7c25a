"""Statistics for an A/B experiment that people watch while it runs, at the unit the split
randomises: the subject (user), not the reply."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import ArrayLike, NDArray

F = NDArray[np.float64]

#: Significance level of the family of verdicts: the chance of ever calling any false winner.
ALPHA = 0.05
#: Variance of the normal mixture over the true difference, in the units of a score in [-1, 1]
#: (tau = 0.15). The mSPRT is most sensitive to differences of about tau at the sample size where
#: the experiment is decided; a steering change worth detecting moves a mean by 0.05-0.3, and
#: 0.15^2 sits within a few % of the best threshold over that range. A metric may declare its own
#: (a relative one: 0.1, a 10 % change). A tau chosen from the data would void the guarantee.
TAU2 = 0.15**2
#: Weight, in degrees of freedom (subjects - 1), of the worst-case variance a bounded metric's
#: plug-in estimate is shrunk toward (:func:`ratio`). Without it two replies per arm, all 1
#: against all 0, estimate variance 0 and call a "certain" winner; with it a handful of subjects
#: are judged as if every subject's replies were one (an ICC of 1), and past ~30 subjects the
#: estimate is the data's.
PRIOR_DF = 4.0
#: Floor of a bounded metric's per-reply variance, for values all at one end of the range: an
#: interval then never shrinks to a point. 0.01: a standard deviation of 0.1.
VAR_FLOOR = 0.01
#: The same floor for an unbounded metric (latency), relative to its mean: a 1 % spread.
REL_FLOOR = 0.01
#: A sample ratio mismatch is flagged below this chi-square p-value: strict, because the check
#: runs on every refresh and a false alarm stops a healthy experiment (the common industry value).
SRM_ALPHA = 0.001
#: Smallest expected count per arm for which the chi-square approximation is trusted; below it the
#: check reports its numbers but flags nothing.
SRM_MIN_EXPECTED = 5.0


class Moments(NamedTuple):
    """One arm's sufficient statistics at the unit of randomisation: ``n`` subjects with at least
    one value, and over those subjects the sums of S (a subject's total), N (its count of values),
    S^2, N^2 and S*N. Each field an array (one experiment or many, one look or every look)."""

    n: F
    s: F
    c: F
    ss: F
    cc: F
    sc: F


def running_moments(subjects: ArrayLike, values: ArrayLike) -> Moments:
    """:class:`Moments` after each reply, along the last axis (replies in arrival order);
    ``values`` NaN where a reply has none (another arm's, or not scored), ``subjects`` any
    integer ids. Vectorised: each subject's running totals come from one stable sort."""
    x = np.asarray(values, dtype=float)
    subj = np.broadcast_to(np.asarray(subjects), x.shape)
    ok = ~np.isnan(x)
    y, one = np.where(ok, x, 0.0), ok.astype(float)
    order = np.argsort(subj, axis=-1, kind="stable")
    ys, os_ = np.take_along_axis(y, order, -1), np.take_along_axis(one, order, -1)
    keys = np.take_along_axis(subj, order, -1)
    starts = np.ones(x.shape, dtype=bool)
    starts[..., 1:] = keys[..., 1:] != keys[..., :-1]
    first = np.maximum.accumulate(np.where(starts, np.arange(x.shape[-1]), 0), axis=-1)
    cy, co = np.cumsum(ys, -1) - ys, np.cumsum(os_, -1) - os_  # exclusive: before this reply
    s_prev_sorted = cy - np.take_along_axis(cy, first, -1)
    n_prev_sorted = co - np.take_along_axis(co, first, -1)
    s_prev, n_prev = np.empty_like(y), np.empty_like(y)
    np.put_along_axis(s_prev, order, s_prev_sorted, -1)
    np.put_along_axis(n_prev, order, n_prev_sorted, -1)
    steps = (
        one * (n_prev == 0),
        y,
        one,
        2 * s_prev * y + y * y,
        one * (2 * n_prev + 1),
        one * (s_prev + y * n_prev + y),
    )
    return Moments(*(np.cumsum(d, -1) for d in steps))


def moments(subjects: ArrayLike, values: ArrayLike) -> Moments:
    """:class:`Moments` of all the replies (the last look of :func:`running_moments`)."""
    m = running_moments(subjects, values)
    return Moments(*(f[..., -1] for f in m))


def ratio(
    m: Moments, lo: float = -1.0, hi: float = 1.0, center: ArrayLike | None = None
) -> tuple[F, F]:
    """(mean, variance of the mean) of one arm: the ratio estimator with its delta-method variance,
    shrunk for bounded metrics and floored."""
    n, c = np.asarray(m.n, dtype=float), np.asarray(m.c, dtype=float)
    with np.errstate(invalid="ignore", divide="ignore"):
        r = m.s / c
        at = r if center is None else np.asarray(center, dtype=float)
        design = m.cc / (c * c)  # 1 / the effective number of replies
        resid = np.maximum(m.ss - 2 * r * m.sc + r * r * m.cc, 0.0)
        emp = np.where(n >= 2, n / (n - 1) * resid / (c * c), np.nan)
        if math.isfinite(lo) and math.isfinite(hi):
            worst = np.maximum((hi - at) * (at - lo), 0.0) * design
            df = np.maximum(n - 1, 0)
            v = (PRIOR_DF * worst + df * np.nan_to_num(emp)) / (PRIOR_DF + df)
            v = np.maximum(v, VAR_FLOOR * design)
        else:
            v = np.maximum(emp, (REL_FLOOR * r) ** 2 * design)
    return r, v


def difference(
    a: Moments, b: Moments, lo: float = -1.0, hi: float = 1.0, relative: bool = False
) -> tuple[F, F]:
    """(a - b, its variance), unpooled: each arm's own variance (shrunk toward the worst case at
    the mean of both); ``relative``: a / b - 1 by the delta method (for a positive metric on a
    ratio scale, latency)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        both = (a.s + b.s) / (a.c + b.c)
    ma, va = ratio(a, lo, hi, both)
    mb, vb = ratio(b, lo, hi, both)
    with np.errstate(invalid="ignore", divide="ignore"):
        if relative:
            return ma / mb - 1, va / mb**2 + ma**2 * vb / mb**4
    return ma - mb, va + vb


def log_mixture_lr(diff: ArrayLike, v: ArrayLike, tau2: float = TAU2) -> F:
    """log of the mSPRT statistic: the likelihood ratio of "difference ~ N(0, tau2)" against
    "difference = 0" for an estimate ``diff`` of variance ``v``. Under the null its exponential is
    a martingale of mean 1, so (Ville) it ever reaches 1/alpha with probability <= alpha."""
    diff, v = np.asarray(diff, dtype=float), np.asarray(v, dtype=float)
    return 0.5 * np.log(v / (v + tau2)) + diff**2 * tau2 / (2 * v * (v + tau2))


def half_width(v: ArrayLike, alpha: float = ALPHA, tau2: float = TAU2) -> F:
    """Half-width of the confidence sequence: the differences d whose mSPRT against ``diff - d``
    stays below 1/alpha (the interval the p-value inverts: 0 is outside it iff p <= alpha)."""
    v = np.asarray(v, dtype=float)
    return np.sqrt(v * (v + tau2) / tau2 * (2 * math.log(1 / alpha) + np.log((v + tau2) / v)))


def always_valid_arrays(
    a: Moments,
    b: Moments,
    lo: float = -1.0,
    hi: float = 1.0,
    alpha: float = ALPHA,
    tau2: float = TAU2,
    relative: bool = False,
) -> tuple[F, F, F]:
    """(difference, half-width, p-value) of arm a against arm b at the subject level, elementwise
    over arrays (NaN where an arm has no subject, or an unbounded metric fewer than 2). The
    p-value is 1/Lambda at this look (capped at 1): not the running minimum over earlier looks,
    which a report rebuilt from the log does not know; it is always valid all the same
    (P(ever <= alpha) <= alpha), only not monotone."""
    diff, v = difference(a, b, lo, hi, relative)
    with np.errstate(invalid="ignore", divide="ignore"):
        p = np.minimum(1.0, np.exp(-log_mixture_lr(diff, v, tau2)))
        return diff, half_width(v, alpha, tau2), p


def fixed_horizon(
    a: Moments, b: Moments, lo: float = -1.0, hi: float = 1.0, relative: bool = False
) -> tuple[F, F, F]:
    """(difference, 95 % half-width, two-sided p-value) of a normal-approximation test on the
    same subject-level variance: valid only when read once, at a sample size planned ahead."""
    from scipy.stats import norm

    diff, v = difference(a, b, lo, hi, relative)
    se = np.sqrt(v)
    with np.errstate(invalid="ignore", divide="ignore"):
        return diff, norm.ppf(0.975) * se, 2 * norm.sf(np.abs(diff) / se)


def family_alpha(alpha: float, size: int) -> float:
    """Each verdict's level in a family of ``size`` (Bonferroni): every look at every verdict
    together calls a false winner with probability <= ``alpha``."""
    return alpha / max(size, 1)


def decide(diff: ArrayLike, half: ArrayLike, enough: ArrayLike) -> NDArray[np.int8]:
    """The verdict at each look: +1 (a above b), -1 (below) where there are ``enough`` values
    and the interval excludes 0, else 0. One rule for the report and the simulations."""
    d, h = np.asarray(diff, dtype=float), np.asarray(half, dtype=float)
    with np.errstate(invalid="ignore"):
        called = np.asarray(enough, dtype=bool) & (np.abs(d) > h)
    return np.where(called, np.sign(d), 0).astype(np.int8)


def scale_needed(v: float, effect: float, alpha: float = ALPHA, tau2: float = TAU2) -> float:
    """How many times the data so far (subjects in both arms, at the same split and replies per
    subject) the confidence sequence needs to be narrower than ``effect``: an effect that large
    would then be called. 1 or less: enough already."""
    from scipy.optimize import brentq

    if not (math.isfinite(v) and v > 0 and effect > 0):
        return math.nan
    if float(half_width(v, alpha, tau2)) <= effect:
        return 1.0
    f = lambda log_k: float(half_width(v / math.exp(log_k), alpha, tau2)) - effect  # noqa: E731
    return math.exp(brentq(f, 0.0, 60.0))


def always_valid(
    a: Sequence[float],
    b: Sequence[float],
    alpha: float = ALPHA,
    tau2: float = TAU2,
    subjects_a: Sequence[Any] | None = None,
    subjects_b: Sequence[Any] | None = None,
) -> dict[str, Any]:
    """mean(a) - mean(b) of scores in [-1, 1] with its always-valid p-value and (1 - alpha)
    confidence sequence ``ci``, each reply its own subject unless ``subjects_*`` say whose it is
    (None where either side has fewer than 2 values)."""
    if len(a) < 2 or len(b) < 2:
        return {"diff": None, "ci": None, "p_value": None}
    ma = moments(_codes(subjects_a, len(a)), np.asarray(a, dtype=float))
    mb = moments(_codes(subjects_b, len(b)), np.asarray(b, dtype=float))
    d, h, p = (float(x) for x in always_valid_arrays(ma, mb, alpha=alpha, tau2=tau2))
    return {"diff": d, "ci": [d - h, d + h], "p_value": p}


def _codes(subjects: Sequence[Any] | None, n: int) -> NDArray[np.int64]:
    if subjects is None:
        return np.arange(n)
    return np.unique(np.asarray(subjects, dtype=object).astype(str), return_inverse=True)[1]


def srm_p_value(n_a: int, n_b: int, split: float) -> float | None:
    """Chi-square goodness-of-fit p-value (1 degree of freedom) of counts ``n_a``, ``n_b`` against
    the shares ``split``, ``1 - split``; None where nothing can be tested (no counts, or a split of
    0 or 1 with nothing in the arm it empties). A count in an arm the split leaves empty: 0."""
    total = n_a + n_b
    if total <= 0:
        return None
    expected = (total * split, total * (1 - split))
    chi2 = 0.0
    for observed, e in zip((n_a, n_b), expected, strict=True):
        if e <= 0:
            if observed > 0:
                return 0.0
            continue
        chi2 += (observed - e) ** 2 / e
    if min(expected) <= 0:
        return None  # all in the one arm the split allows: nothing to test
    # the chi-square survival function for 1 degree of freedom: P(Z^2 > chi2) = erfc(sqrt(chi2/2))
    return math.erfc(math.sqrt(chi2 / 2))


def srm(
    n_a: int, n_b: int, split: float, alpha: float = SRM_ALPHA, unit: str = "subjects"
) -> dict[str, Any]:
    """Did arm a get ``split`` of the ``unit`` s? ``flagged`` when the chi-square p-value is below
    ``alpha`` and each arm's expected count is at least :data:`SRM_MIN_EXPECTED` (the
    approximation holds), or when an arm the split leaves empty got any."""
    total = n_a + n_b
    p = srm_p_value(n_a, n_b, split)
    min_expected = total * min(split, 1 - split)
    trusted = min_expected >= SRM_MIN_EXPECTED or p == 0.0
    return {
        "unit": unit,
        "split": split,
        "counts": [n_a, n_b],
        "observed_share": None if total == 0 else n_a / total,
        "p_value": p,
        "alpha": alpha,
        "checked": p is not None and trusted,
        "flagged": p is not None and trusted and p < alpha,
    }


def srm_arms(
    counts: Sequence[int], shares: Sequence[float], alpha: float = SRM_ALPHA, unit: str = "subjects"
) -> dict[str, Any]:
    """:func:`srm` for any number of arms: a chi-square goodness-of-fit test (k - 1 degrees of
    freedom) of ``counts`` against the allocation's ``shares``; an arm the allocation leaves
    empty that got any is a mismatch at once (p = 0)."""
    from scipy.stats import chi2

    total = sum(counts)
    expected = [total * s for s in shares]
    p: float | None
    if total <= 0:
        p = None
    elif any(e <= 0 < o for o, e in zip(counts, expected, strict=True)):
        p = 0.0
    else:
        live = [(o, e) for o, e in zip(counts, expected, strict=True) if e > 0]
        stat = sum((o - e) ** 2 / e for o, e in live)
        p = float(chi2.sf(stat, len(live) - 1)) if len(live) > 1 else None
    live_expected = [e for e in expected if e > 0]
    trusted = p == 0.0 or (bool(live_expected) and min(live_expected) >= SRM_MIN_EXPECTED)
    return {
        "unit": unit,
        "counts": list(counts),
        "p_value": p,
        "alpha": alpha,
        "checked": p is not None and trusted,
        "flagged": p is not None and trusted and p < alpha,
    }


def one_sample(
    m: Moments,
    lo: float = -1.0,
    hi: float = 1.0,
    alpha: float = ALPHA,
    tau2: float = TAU2,
) -> tuple[F, F, F]:
    """(mean, half-width, p-value) of one sample's mean against 0 at the subject level, always
    valid: the mSPRT of :func:`always_valid_arrays` with the other arm known to be 0 (a paired
    preference: +1, -1 or 0 per pair). The variance is shrunk toward the worst case at 0, the
    mean the null says it has."""
    r, v = ratio(m, lo, hi, center=np.zeros_like(np.asarray(m.n, dtype=float)))
    with np.errstate(invalid="ignore", divide="ignore"):
        p = np.minimum(1.0, np.exp(-log_mixture_lr(r, v, tau2)))
        return r, half_width(v, alpha, tau2), p
