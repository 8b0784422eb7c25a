"""Statistics for an A/B experiment that people watch while it runs.

A fixed-horizon test (a Welch 95 % CI read once at a planned sample size) is only valid when read
once: the ``/experiments`` page refreshes every 2 s, and calling a winner at the first look whose
CI excludes 0 finds false winners far more often than 5 % (tests/test_ab_stats.py measures it).
This module gives the numbers that stay valid however often they are read:

- :func:`always_valid`: a mixture sequential probability ratio test (mSPRT; Robbins 1970; Johari,
  Koomen, Pekelis and Walsh, "Always valid inference", 2017/2022; Optimizely's Stats Engine) for
  mean(steered) - mean(unsteered): an always-valid p-value and its confidence sequence, an
  interval that covers the true difference at every sample size at once with probability 0.95.
- :func:`srm`: a sample-ratio-mismatch check (the arms got the share of subjects the split
  assigns?), since a broken assignment or a logging loss in one arm biases any comparison.

Pure numpy and math; every function takes arrays too (a simulation runs thousands of experiments
at once through the same code the report uses).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

#: Significance level of the always-valid test: the chance of ever calling a false winner.
ALPHA = 0.05
#: Variance of the normal mixture over the true difference (in score units squared; tau = 0.15).
#: The mSPRT is most sensitive to differences of about tau at the sample size where the experiment
#: is decided: its threshold is lowest where tau^2 is about 10x the variance of the estimated
#: difference, and nearly flat around it. Feedback scores lie in [-1, 1], so a steering change
#: worth detecting moves the mean by about 0.05-0.3; with per-reply score variance 0.25 ({0, 1}
#: thumbs) to 1 ({-1, 1}) and 100-1000 scored replies per arm, 0.15^2 sits within a few % of the
#: best threshold over that whole range. A tau chosen from the data would void the guarantee.
TAU2 = 0.15**2
#: The range of a feedback score (the server's ``SCORE_MIN``, ``SCORE_MAX``): it bounds the
#: variance a score can have, which is what keeps the plug-in honest on a handful of replies.
SCORE_LO, SCORE_HI = -1.0, 1.0
#: Weight, in degrees of freedom, of the worst-case variance the plug-in estimate is shrunk
#: toward (see :func:`pooled_variance`). Without it two replies per arm, all 1 against all 0,
#: estimate variance 0 and call a "certain" winner: peeking at every reply from 2 per arm up to
#: 200 then found false winners in 16 % of simulated A/A runs; with 4, in 1.7 % (the report lets
#: the display floor go down to 2). Past ~30 replies per arm the estimate is the data's: power
#: for 0.65 vs 0.5 thumbs-up within 500 per arm is 97.4 % either way (tests/test_ab_stats.py).
PRIOR_DF = 4.0
#: Floor of the plug-in score variance, for scores all at one end of the range (where even the
#: worst case is 0): an interval then never shrinks to a point. 0.01: a standard deviation of 0.1.
VAR_FLOOR = 0.01
#: A sample ratio mismatch is flagged below this chi-square p-value: strict, because the check
#: runs on every refresh and a false alarm stops a healthy experiment (the common industry value).
SRM_ALPHA = 0.001
#: Smallest expected count per arm for which the chi-square approximation is trusted; below it the
#: check reports its numbers but flags nothing.
SRM_MIN_EXPECTED = 5.0


def pooled_variance(
    n_a: ArrayLike,
    mean_a: ArrayLike,
    var_a: ArrayLike,
    n_b: ArrayLike,
    mean_b: ArrayLike,
    var_b: ArrayLike,
) -> NDArray[np.float64]:
    """The per-reply score variance the mSPRT plugs in: the two arms pooled (under the null they
    share one distribution, so one estimate from both is the steadier), shrunk with
    :data:`PRIOR_DF` degrees of freedom toward the largest variance a score in [SCORE_LO,
    SCORE_HI] with the pooled mean can have ((hi - m)(m - lo), Bhatia-Davis), floored at
    :data:`VAR_FLOOR`. ``var_*`` with ddof=1; counts >= 2."""
    n_a, n_b = np.asarray(n_a, dtype=float), np.asarray(n_b, dtype=float)
    df = n_a + n_b - 2
    pooled = ((n_a - 1) * np.asarray(var_a) + (n_b - 1) * np.asarray(var_b)) / df
    m = (n_a * np.asarray(mean_a) + n_b * np.asarray(mean_b)) / (n_a + n_b)
    worst = np.maximum((SCORE_HI - m) * (m - SCORE_LO), 0.0)
    return np.maximum((PRIOR_DF * worst + df * pooled) / (PRIOR_DF + df), VAR_FLOOR)


def log_mixture_lr(diff: ArrayLike, v: ArrayLike, tau2: float = TAU2) -> NDArray[np.float64]:
    """log of the mSPRT statistic: the likelihood ratio of "difference ~ N(0, tau2)" against
    "difference = 0" for an estimate ``diff`` of variance ``v``. Under the null its exponential is
    a martingale of mean 1, so (Ville) it ever reaches 1/alpha with probability <= alpha."""
    diff, v = np.asarray(diff, dtype=float), np.asarray(v, dtype=float)
    return 0.5 * np.log(v / (v + tau2)) + diff**2 * tau2 / (2 * v * (v + tau2))


def half_width(v: ArrayLike, alpha: float = ALPHA, tau2: float = TAU2) -> NDArray[np.float64]:
    """Half-width of the confidence sequence: the differences d whose mSPRT against ``diff - d``
    stays below 1/alpha (the interval the p-value inverts: 0 is outside it iff p <= alpha)."""
    v = np.asarray(v, dtype=float)
    return np.sqrt(v * (v + tau2) / tau2 * (2 * math.log(1 / alpha) + np.log((v + tau2) / v)))


def always_valid_arrays(
    n_a: ArrayLike,
    mean_a: ArrayLike,
    var_a: ArrayLike,
    n_b: ArrayLike,
    mean_b: ArrayLike,
    var_b: ArrayLike,
    alpha: float = ALPHA,
    tau2: float = TAU2,
) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]]:
    """(difference, half-width, p-value) of mean_a - mean_b from each arm's count, mean and
    variance (ddof=1; counts >= 2), elementwise over arrays. The p-value is 1/Lambda at this
    sample (capped at 1): not the running minimum over earlier looks, which a report rebuilt from
    the log does not know; it is always valid all the same (P(ever <= alpha) <= alpha), only not
    monotone: a winner called on a lucky streak can be uncalled as the evidence fades."""
    n_a, n_b = np.asarray(n_a, dtype=float), np.asarray(n_b, dtype=float)
    v = pooled_variance(n_a, mean_a, var_a, n_b, mean_b, var_b) * (1 / n_a + 1 / n_b)
    diff = np.asarray(mean_a, dtype=float) - np.asarray(mean_b, dtype=float)
    p = np.minimum(1.0, np.exp(-log_mixture_lr(diff, v, tau2)))
    return diff, half_width(v, alpha, tau2), p


def always_valid(
    a: Sequence[float], b: Sequence[float], alpha: float = ALPHA, tau2: float = TAU2
) -> dict[str, Any]:
    """mean(a) - mean(b) with its always-valid p-value and (1 - alpha) confidence sequence,
    ``ci`` (None where either side has fewer than 2 values)."""
    if len(a) < 2 or len(b) < 2:
        return {"diff": None, "ci": None, "p_value": None}
    xa, xb = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    d, h, p = always_valid_arrays(
        len(xa), xa.mean(), xa.var(ddof=1), len(xb), xb.mean(), xb.var(ddof=1), alpha, tau2
    )
    d, h = float(d), float(h)
    return {"diff": d, "ci": [d - h, d + h], "p_value": float(p)}


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
