"""Issue 56, item 5: the A/B verdicts hold on traffic shaped like real traffic.

Seeded A/A experiments (both arms one distribution: every winner is false) with users whose
replies are correlated (ICC 0 to 1/3), heavy users (40 users x 50 replies), uneven splits with
unequal variances, a latency guardrail, and 5 languages x 3 metrics, each verdict of the family
read at EVERY reply (continuous peeking) by the report's rule through the public functions
(``stats.running_moments`` -> ``stats.always_valid_arrays`` at ``stats.family_alpha`` ->
``stats.decide``): false winners <= 5 % in every scenario, the binomial 95 % interval's upper
end included. Power is stated at the user level. And the acceptance logs through
``steerserve ab-report``: 60 A/A experiments of 40 correlated users x 50 replies call a winner in
at most 6; 20 with a real effect (+0.3, 400 users x 5) call "steered" in at least 18, never
"unsteered".

``python tests/server/ab/test_ab_simulation.py`` prints the table docs/ab.md shows.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import binomtest

sys.path.insert(0, str(Path(__file__).parent))
from _ab_sim import EFFECT, NULL, Scenario, Sim, uniform_users, write_log  # noqa: E402

from steerserve.server.ab import metrics as ab_metrics  # noqa: E402
from steerserve.server.ab import stats as ab_stats  # noqa: E402
from steerserve.server.ab.analysis import MIN_SCORED, build_report  # noqa: E402

SEEDS = {label: 5600 + i for i, label in enumerate(NULL)} | {
    label: 5700 + i for i, label in enumerate(EFFECT)
}


def verdicts(sim: Sim, n_languages: int) -> dict[tuple[str, int], np.ndarray]:
    """Every verdict of the family at every reply: (metric, group) -> (experiments, replies)
    of +1 (steered above), -1, 0. Group -1 is "all", k a language (when there are several):
    the family the report corrects for."""
    groups = {-1: np.ones_like(sim.steered)}
    if n_languages > 1:
        groups |= {k: sim.language == k for k in range(n_languages)}
    alpha = ab_stats.family_alpha(ab_stats.ALPHA, len(groups) * len(sim.values))
    out = {}
    for name, x in sim.values.items():
        m = ab_metrics.get(name)
        for g, mask in groups.items():
            a = ab_stats.running_moments(sim.subjects, np.where(mask & sim.steered, x, np.nan))
            b = ab_stats.running_moments(sim.subjects, np.where(mask & ~sim.steered, x, np.nan))
            d, h, _ = ab_stats.always_valid_arrays(a, b, m.lo, m.hi, alpha, m.tau**2, m.relative)
            enough = (a.c >= MIN_SCORED) & (b.c >= MIN_SCORED) & (a.n >= 2) & (b.n >= 2)
            out[name, g] = ab_stats.decide(d, h, enough)
    return out


def interval(k: int, n: int) -> tuple[float, float]:
    ci = binomtest(k, n).proportion_ci(0.95, method="exact")
    return ci.low, ci.high


def false_winners(label: str) -> tuple[int, int]:
    """(experiments with any false verdict at any reply, experiments) of a NULL scenario."""
    sc = NULL[label]
    calls = verdicts(sc.run(SEEDS[label]), sc.n_languages)
    ever = np.zeros(sc.n_exp, dtype=bool)
    for c in calls.values():
        ever |= (c != 0).any(1)
    return int(ever.sum()), sc.n_exp


def power(label: str) -> tuple[int, int, int]:
    """(steered called, unsteered called, experiments) of an EFFECT scenario, by its last reply."""
    sc = EFFECT[label]
    c = verdicts(sc.run(SEEDS[label]), 1)["feedback", -1]
    return int((c > 0).any(1).sum()), int((c < 0).any(1).sum()), sc.n_exp


@pytest.mark.parametrize("label", list(NULL))
def test_a_a_false_winners_stay_under_5_percent_at_every_reply(label: str) -> None:
    """Measured (these seeds): ICC 0 0.1 %, 0.05 0 %, 0.2 0.2 %, 0.33 0.3 %, heavy users 0 %,
    splits 0.1 / 0.25 / 0.5 1.9 / 2.4 / 3.2 %, latency 2.3 %, 5 x 3 0.3 % (docs/ab.md has the
    table; the code before issue 56 called 2.6 to 69.7 % on the same traffic)."""
    k, n = false_winners(label)
    lo, hi = interval(k, n)
    assert hi <= 0.05, f"{label}: {k}/{n} false winners, 95 % CI [{lo:.3f}, {hi:.3f}]"


def test_power_at_the_user_level_and_never_the_wrong_arm() -> None:
    """0.65 vs 0.5 thumbs-up: 1,000 independent users found in >= 90 % (measured 97.8 %); 200
    users x 5 replies at an ICC of 0.2, which hold less information, in >= 55 % (70.0 %); 0.55
    vs 0.5 is stated, not required (60.4 % of 4,000 users, 36.0 % of 800 x 5); no scenario
    ever calls the unsteered arm."""
    got = {label: power(label) for label in EFFECT}
    for steered, unsteered, n in got.values():
        assert unsteered == 0 and steered <= n
    first, second = list(EFFECT)[:2]
    assert got[first][0] / got[first][2] >= 0.9, got
    assert got[second][0] / got[second][2] >= 0.55, got


def test_the_report_calls_what_the_vectorised_rule_calls() -> None:
    """The simulation's rule is the report's: on 40 experiments of the 5 x 3 scenario, read once
    at their last reply, ``build_report`` calls a verdict exactly where the rule does."""
    from steerserve.server.ab.records import Row

    sc = Scenario(60, 10, 0.5, {"feedback": uniform_users(0.25, 0.0, 0.75)}, n_exp=40)
    sim = sc.run(9)
    calls = verdicts(sim, 1)["feedback", -1][:, -1]
    called = []
    for e in range(sc.n_exp):
        rows = [
            Row(
                f"r{j}",
                "e",
                "steered" if sim.steered[e, j] else "unsteered",
                "ja",
                None,
                float(sim.values["feedback"][e, j]),
                subject_hash=f"u{sim.subjects[e, j]}",
            )
            for j in range(sim.subjects.shape[1])
        ]
        o = build_report(rows)["experiments"]["e"]["overall"]
        called.append({"steered": 1, "unsteered": -1, None: 0}[o["winner"]])
    assert called == calls.tolist()
    assert 0 < sum(called) < sc.n_exp  # both outcomes occur: the comparison can fail


def test_ab_report_on_correlated_a_a_logs_and_on_a_real_effect(tmp_path: Path) -> None:
    """The acceptance logs, through ``steerserve ab-report``: 60 A/A experiments of 40 users x
    50 replies (each user's thumbs-up rate ~ Beta(1, 1)) call a winner in <= 6 (measured 0;
    before issue 56, 28); 20 experiments with a real effect, +0.3 (400 users x 5), call
    "steered" in >= 18 (measured 20), never "unsteered"."""
    from typer.testing import CliRunner

    from steerserve.cli import app

    aa = Scenario(40, 50, 0.5, {"feedback": uniform_users(0.0, 0.0, 1.0)}, n_exp=60).run(56)
    effect = Scenario(400, 5, 0.5, {"feedback": uniform_users(0.3, 0.0, 0.7)}, n_exp=20).run(57)
    for name, sim, most, least in (("aa", aa, 6, 0), ("effect", effect, 20, 18)):
        log = tmp_path / f"{name}.jsonl"
        write_log(str(log), [(name, sim)])
        out = CliRunner().invoke(app, ["ab-report", str(log)])
        assert out.exit_code == 0, out.output
        verdicts = [v.split(":", 1)[1].split()[0] for v in out.output.split("**Verdict")[1:]]
        assert len(verdicts) == sim.subjects.shape[0]
        n_steered = verdicts.count("steered")
        assert n_steered + verdicts.count("unsteered") <= most, verdicts
        assert n_steered >= least and (name == "aa" or "unsteered" not in verdicts), verdicts


def preference_calls(
    seed: int,
    n_exp: int,
    users: int,
    per_user: int,
    lean: tuple[float, float],
    spread: float,
    by_subject: bool = True,
) -> tuple[int, int, int]:
    """(experiments calling B at any look, calling A, experiments) of paired preferences read at
    every pair by the report's rule (``stats.one_sample`` at the family's level, 30 pairs and 2
    subjects first): each user leans its own way (P(B) = p_b + d, P(A) = p_a - d, d uniform
    within ``spread``), the rest ties; ``by_subject`` False: each pair its own subject (the rule
    a per-pair test would use)."""
    rng = np.random.default_rng(seed)
    p_b, p_a = lean
    d = rng.uniform(-spread, spread, (n_exp, users))
    slots = rng.permuted(np.tile(np.repeat(np.arange(users), per_user), (n_exp, 1)), axis=1)
    pb = np.take_along_axis(p_b + d, slots, 1)
    pa = np.take_along_axis(p_a - d, slots, 1)
    u = rng.random(slots.shape)
    x = np.where(u < pb, 1.0, np.where(u < pb + pa, -1.0, 0.0))
    subjects = slots if by_subject else np.tile(np.arange(slots.shape[1]), (n_exp, 1))
    m = ab_metrics.get("preference")
    mo = ab_stats.running_moments(subjects, x)
    alpha = ab_stats.family_alpha(ab_stats.ALPHA, 2)  # all + one language, as a report has it
    r, h, _ = ab_stats.one_sample(mo, m.lo, m.hi, alpha, m.tau**2)
    calls = ab_stats.decide(r, h, (mo.c >= MIN_SCORED) & (mo.n >= 2))
    return int((calls > 0).any(1).sum()), int((calls < 0).any(1).sum()), n_exp


def test_paired_preferences_hold_their_level_at_every_pair_and_find_a_real_one() -> None:
    """Preferences with no true preference (each user leaning its own way, spread 0.3, ties
    20 %), 40 heavy users x 25 pairs, read at every pair: false calls measured 0.4 % (4 of
    1,000; each pair taken as its own subject instead: 19.3 %); a true preference (P(B) 0.5,
    P(A) 0.3) of 200 users x 5 pairs is found in 99.8 % and never the wrong way."""
    b, a, n = preference_calls(5750, 1000, 40, 25, (0.4, 0.4), 0.3)
    lo, hi = interval(a + b, n)
    assert hi <= 0.05, f"{a + b}/{n} false calls, 95 % CI [{lo:.3f}, {hi:.3f}]"
    naive = sum(preference_calls(5750, 1000, 40, 25, (0.4, 0.4), 0.3, by_subject=False)[:2])
    assert naive > 5 * (a + b) + 50  # the cluster the subject-level test accounts for
    b, a, n = preference_calls(5751, 500, 200, 5, (0.5, 0.3), 0.2)
    assert a == 0 and b / n >= 0.9, (b, a, n)


def table() -> str:
    """The suite's numbers as docs/ab.md shows them."""
    lines = ["| scenario | experiments | false winners [95 % CI] |", "|---|---|---|"]
    for label in NULL:
        k, n = false_winners(label)
        lo, hi = interval(k, n)
        lines.append(f"| {label} | {n} | {k / n:.1%} [{lo:.1%}, {hi:.1%}] |")
    lines += ["", "| scenario | experiments | power [95 % CI] |", "|---|---|---|"]
    for label in EFFECT:
        k, wrong, n = power(label)
        lo, hi = interval(k, n)
        lines.append(f"| {label} | {n} | {k / n:.1%} [{lo:.1%}, {hi:.1%}] (wrong arm: {wrong}) |")
    b, a, n = preference_calls(5750, 1000, 40, 25, (0.4, 0.4), 0.3)
    nb, na, _ = preference_calls(5750, 1000, 40, 25, (0.4, 0.4), 0.3, by_subject=False)
    pb, pa, pn = preference_calls(5751, 500, 200, 5, (0.5, 0.3), 0.2)
    lines += [
        "",
        f"preferences A/A (40 x 25, every pair): {(a + b) / n:.1%} false calls "
        f"(each pair its own subject: {(na + nb) / n:.1%}); P(B) 0.5 vs P(A) 0.3 (200 x 5): "
        f"{pb / pn:.1%} called B, {pa} called A",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(json.dumps({"min_scored": MIN_SCORED, "alpha": ab_stats.ALPHA}))
    print(table())
