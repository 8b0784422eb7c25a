"""A/B statistics at the unit of randomisation: the per-subject moments and their delta-method
variance against brute force, the always-valid test on a handful of replies, the confidence
sequence's coverage at every look, the sample-ratio-mismatch check, and the report's keys and
markdown. The false-winner rates and power of the whole rule are tests/server/ab/test_ab_simulation.py's.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from steerserve.server.ab import stats as ab_stats
from steerserve.server.ab.analysis import Row, build_report, render, report_markdown


def _brute(subjects: np.ndarray, x: np.ndarray) -> list[float]:
    """Moments of one arm by the definition: per subject the sum and count of its values."""
    per: dict[int, list[float]] = {}
    for u, v in zip(subjects, x, strict=True):
        if not np.isnan(v):
            per.setdefault(int(u), []).append(float(v))
    s = np.array([sum(v) for v in per.values()])
    c = np.array([len(v) for v in per.values()], dtype=float)
    return [len(per), s.sum(), c.sum(), (s * s).sum(), (c * c).sum(), (s * c).sum()]


def test_running_moments_are_each_subjects_sums_at_every_look() -> None:
    rng = np.random.default_rng(1)
    subjects = rng.integers(0, 9, (4, 60))
    x = rng.random((4, 60))
    x[rng.random((4, 60)) < 0.3] = np.nan  # another arm's, or not scored
    m = ab_stats.running_moments(subjects, x)
    for e in range(4):
        for t in (0, 7, 30, 59):
            want = _brute(subjects[e, : t + 1], x[e, : t + 1])
            assert np.allclose([f[e, t] for f in m], want), (e, t)


def test_ratio_is_the_delta_method_and_the_plain_mean_for_one_reply_each() -> None:
    """Per-subject sums: the delta-method variance of the ratio mean is the cluster-robust one
    (residuals summed within subjects); with one reply per subject it is var / n; shrinkage
    toward the worst case fades with the number of subjects."""
    rng = np.random.default_rng(2)
    users = np.repeat(np.arange(300), 4)
    p = rng.random(300)[users]
    x = (rng.random(users.size) < p).astype(float)
    r, v = ab_stats.ratio(ab_stats.moments(users, x), 0.0, 1.0)
    e = np.bincount(users, x - x.mean())  # each subject's residual sum
    cluster = (e**2).sum() * 300 / 299 / x.size**2
    assert r == pytest.approx(x.mean()) and v == pytest.approx(cluster, rel=0.02)
    assert v > 1.5 * x.var(ddof=1) / x.size  # ICC 1/3: the per-reply variance is far too small
    iid = rng.random(500)
    r1, v1 = ab_stats.ratio(ab_stats.moments(np.arange(500), iid), 0.0, 1.0)
    worst = r1 * (1 - r1) / 500  # Bhatia-Davis on [0, 1]
    k, df = ab_stats.PRIOR_DF, 499
    assert v1 == pytest.approx((k * worst + df * iid.var(ddof=1) / 500) / (k + df), rel=1e-9)


def test_peeking_at_every_reply_from_two_per_arm_stays_under_5_percent() -> None:
    """The report lets ``--min-scored`` go down to 2, so the test must hold on a handful of
    replies: 2,000 A/A runs of {0, 1} scores looked at after every reply from 2 per arm to 400
    (measured, seed 49: 2.05 % false winners; the plug-in without its shrinkage toward the
    worst-case variance: 15.8 %)."""
    rng = np.random.default_rng(49)
    x = (rng.random((2000, 400)) < 0.5).astype(float)
    steered = np.tile(np.arange(400) % 2 == 0, (2000, 1))
    subjects = np.arange(400)
    a = ab_stats.running_moments(subjects, np.where(steered, x, np.nan))
    b = ab_stats.running_moments(subjects, np.where(~steered, x, np.nan))
    d, h, p = ab_stats.always_valid_arrays(a, b)
    called = ab_stats.decide(d, h, (a.c >= 2) & (b.c >= 2)) != 0
    assert np.array_equal(called, (a.c >= 2) & (b.c >= 2) & (p < ab_stats.ALPHA))  # CI and p
    assert called.any(1).mean() <= 0.05, called.any(1).mean()


def test_the_confidence_sequence_covers_the_truth_at_every_look() -> None:
    """500 experiments of 0.65 vs 0.5 thumbs-up, 100 users x 5 replies with an ICC of 0.2: the
    subject-level interval covers the true difference, 0.15, at every look at once in >= 95 %
    of them (measured, seed 48: 99.6 %)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from _ab_sim import Scenario, bernoulli

    sim = Scenario(100, 5, 0.5, {"feedback": bernoulli(0.65, 0.5, 0.2)}, n_exp=500).run(48)
    x = sim.values["feedback"]
    a = ab_stats.running_moments(sim.subjects, np.where(sim.steered, x, np.nan))
    b = ab_stats.running_moments(sim.subjects, np.where(~sim.steered, x, np.nan))
    d, h, _ = ab_stats.always_valid_arrays(a, b)
    look = (a.n >= 2) & (b.n >= 2)
    covered = (~look | (np.abs(d - 0.15) <= h)).all(1).mean()
    assert covered >= 0.95, covered


def test_always_valid_small_cases() -> None:
    """Fewer than 2 in an arm: nothing computed; scores all alike: the variance floor keeps the
    interval open and the p-value a number (no division by zero, no certainty from 2 replies);
    the same replies from one subject are one subject's evidence, not 200."""
    assert ab_stats.always_valid([1.0], [0.0, 1.0]) == {"diff": None, "ci": None, "p_value": None}
    same = ab_stats.always_valid([1.0] * 5, [1.0] * 5)
    assert same["diff"] == 0 and same["p_value"] == 1.0 and same["ci"][0] < 0 < same["ci"][1]
    apart = ab_stats.always_valid([1.0, 1.0], [0.0, 0.0])
    assert apart["ci"][0] < 0 and apart["p_value"] > ab_stats.ALPHA
    far = ab_stats.always_valid([1.0] * 200, [0.0] * 200)
    assert far["p_value"] < 1e-6 and 0 < far["ci"][0] < 1 < far["ci"][1] < 2
    one_each = ab_stats.always_valid(
        [1.0] * 200, [0.0] * 200, subjects_a=["u"] * 200, subjects_b=["v"] * 200
    )
    assert one_each["p_value"] > 0.5  # one subject per arm: no evidence however many replies


def test_sample_still_needed_shrinks_the_interval_to_the_effect() -> None:
    v = 0.01
    k = ab_stats.scale_needed(v, 0.05)
    assert k > 1 and float(ab_stats.half_width(v / k)) == pytest.approx(0.05, rel=1e-6)
    assert ab_stats.scale_needed(v, 10.0) == 1.0  # enough already
    assert np.isnan(ab_stats.scale_needed(float("nan"), 0.05))


def test_srm_flags_a_mismatch_and_not_an_even_split() -> None:
    even = ab_stats.srm(500, 500, 0.5)
    assert even["checked"] and not even["flagged"] and even["p_value"] == pytest.approx(1.0)
    off = ab_stats.srm(500, 620, 0.5)  # chi-square 12.9, p = 0.00034
    assert off["flagged"] and off["p_value"] == pytest.approx(3.4e-4, rel=0.05)
    assert not ab_stats.srm(500, 560, 0.5)["flagged"]  # p = 0.065: chance
    assert not ab_stats.srm(200, 800, 0.2)["flagged"]  # an uneven split, kept
    assert ab_stats.srm(300, 700, 0.2)["flagged"]


@pytest.mark.parametrize(
    ("counts", "split", "flagged"),
    [
        ((0, 0), 0.5, False),  # nothing yet
        ((0, 10), 0.5, False),  # one arm gets nobody: chi-square 10, p = 0.0016: not yet
        ((0, 20), 0.5, True),  # p = 8e-6
        ((0, 10), 0.0, False),  # the split steers nobody, nobody steered: nothing to test
        ((10, 0), 1.0, False),
        ((1, 10), 0.0, True),  # someone steered where the split steers nobody
        ((10, 1), 1.0, True),
        ((1, 2), 0.5, False),  # too few to test
    ],
)
def test_srm_edge_cases_do_not_raise(counts: tuple[int, int], split: float, flagged: bool) -> None:
    out = ab_stats.srm(*counts, split)
    assert out["flagged"] is flagged, out
    json.dumps(out, allow_nan=False)


def _rows(
    scores: dict[str, list[float]], users: dict[str, int] | None = None, exp: str = "e1"
) -> list[Row]:
    """Rows of one experiment: scores per arm, and ``users[arm]`` distinct subjects sharing
    them (None: no subject hashes, a log from before they were recorded)."""
    rows = []
    for arm, given in scores.items():
        for i, s in enumerate(given):
            subject = None if users is None else f"{arm}-{i % users[arm]}"
            rows.append(Row(f"{arm}-{i}", exp, arm, "ja", 100.0, s, subject_hash=subject))
    return rows


def test_report_calls_on_the_always_valid_test_and_keeps_the_fixed_horizon_view() -> None:
    """100 vs 100 replies whose fixed-horizon CI excludes 0 (z = 2.6) but whose evidence is not
    enough for the always-valid test: the verdict calls no winner; the fixed-horizon view, with
    its note, would have. The markdown shows both, labelled."""
    steered = [1.0] * 63 + [0.0] * 37
    unsteered = [1.0] * 45 + [0.0] * 55
    rep = build_report(
        _rows({"steered": steered, "unsteered": unsteered}, {"steered": 100, "unsteered": 100})
    )
    exp = rep["experiments"]["e1"]
    o = exp["overall"]
    assert o["winner"] is None and o["verdict"].startswith("no significant difference")
    assert set(o["difference"]) >= {"diff", "ci", "p_value", "method", "alpha"}
    assert o["difference"]["p_value"] > o["difference"]["alpha"] and o["difference"]["ci"][0] < 0
    fh = o["fixed_horizon"]
    assert fh["ci95"][0] > 0 and fh["p_value"] < 0.05 and "valid only when read once" in fh["note"]
    assert fh["diff"] == pytest.approx(o["difference"]["diff"])
    # two metrics (feedback, latency_ms) in one group: each verdict at 0.05 / 2
    assert exp["family"]["size"] == 2 and exp["family"]["each"] == pytest.approx(0.025)
    assert exp["family"]["metrics"] == ["feedback", "latency_ms"]
    assert o["metrics"]["language_match"] if "language_match" in o["metrics"] else True
    md = report_markdown(rep)
    assert "Fixed-horizon view (feedback, overall): +0.18" in md and "valid only when" in md
    assert "always-valid" in md and "SAMPLE RATIO MISMATCH" not in md
    assert "Bonferroni over 2 verdicts" in md
    assert "the allocation is not recorded" in md  # no split given: not checked, and said
    json.loads(render(rep, "json"))


def test_report_srm_block_counts_subjects_and_warns_loudly() -> None:
    """With the split given, the report checks distinct subjects per arm (one heavy user's
    requests are not a mismatch) and the markdown warns loudly when the split is off."""
    scores = {"steered": [1.0, 0.0] * 300, "unsteered": [1.0, 0.0] * 300}
    # 600 requests per arm from 100 subjects each: even
    ok = build_report(_rows(scores, {"steered": 100, "unsteered": 100}), splits={"e1": 0.5})
    srm = ok["experiments"]["e1"]["srm"]
    assert srm["unit"] == "subjects" and srm["counts"] == {"steered": 100, "unsteered": 100}
    assert srm["requests"] == {"steered": 600, "unsteered": 600}
    assert srm["checked"] and not srm["flagged"] and srm["split"] == 0.5
    heavy = {"steered": [1.0] * 900, "unsteered": [1.0] * 300}  # 3x the requests, same users
    srm = build_report(_rows(heavy, {"steered": 100, "unsteered": 100}), splits={"e1": 0.5})
    assert not srm["experiments"]["e1"]["srm"]["flagged"]
    bad = build_report(_rows(scores, {"steered": 200, "unsteered": 300}), splits={"e1": 0.5})
    srm = bad["experiments"]["e1"]["srm"]
    assert srm["flagged"] and srm["p_value"] < ab_stats.SRM_ALPHA
    md = report_markdown(bad)
    assert "**WARNING: SAMPLE RATIO MISMATCH" in md
    assert "200 steered / 300 unsteered subjects" in md
    # a log without subject hashes: requests are counted, and the unit says so
    old = build_report(_rows(scores), splits={"e1": 0.5})["experiments"]["e1"]["srm"]
    assert old["unit"] == "requests" and old["counts"] == {"steered": 600, "unsteered": 600}
    # a split for another experiment checks nothing here
    other = build_report(_rows(scores, {"steered": 9, "unsteered": 1}), splits={"e2": 0.5})
    assert not other["experiments"]["e1"]["srm"]["checked"]
