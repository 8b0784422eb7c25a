"""Seeded A/B traffic for the simulation suite (tests/server/ab/test_ab_simulation.py): many experiments at
once as (experiment, reply) arrays, users sticky in one arm, replies arriving in random order, a
per-user random effect setting the intra-class correlation (ICC). Pure numpy, no engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

#: A metric's generator: (rng, the users' arm (E, U), the replies' users (E, T)) -> values (E, T).
Gen = Callable[[np.random.Generator, NDArray[np.bool_], NDArray[np.int64]], NDArray[np.float64]]


@dataclass
class Sim:
    """``n_exp`` experiments of ``T`` replies each, in arrival order."""

    subjects: NDArray[np.int64]  # (E, T): the user of each reply (0..U-1 within its experiment)
    steered: NDArray[np.bool_]  # (E, T): the reply's arm (its user's)
    language: NDArray[np.int64]  # (E, T): the reply's language (its user's)
    values: dict[str, NDArray[np.float64]] = field(default_factory=dict)  # (E, T) per metric


def simulate(
    rng: np.random.Generator,
    n_exp: int,
    n_users: int,
    per_user: int,
    split: float,
    metrics: dict[str, Gen],
    n_languages: int = 1,
) -> Sim:
    """Users assigned to the steered arm with probability ``split`` (sticky), each sending
    ``per_user`` replies, all replies of an experiment shuffled into one arrival order; each
    user speaks one of ``n_languages`` languages."""
    arm = rng.random((n_exp, n_users)) < split
    lang = rng.integers(0, n_languages, (n_exp, n_users))
    slots = np.tile(np.repeat(np.arange(n_users), per_user), (n_exp, 1))
    users = rng.permuted(slots, axis=1)
    sim = Sim(users, np.take_along_axis(arm, users, 1), np.take_along_axis(lang, users, 1))
    for name, gen in metrics.items():
        sim.values[name] = gen(rng, arm, users)
    return sim


def _beta_means(
    rng: np.random.Generator, mean: NDArray[np.float64], icc: float
) -> NDArray[np.float64]:
    """Per-user success rates with mean ``mean`` and ICC ``icc`` (Beta with a + b = 1/icc - 1:
    the share of a Bernoulli score's variance that lies between users); icc 0: all ``mean``."""
    if icc <= 0:
        return mean
    k = 1 / icc - 1
    return rng.beta(mean * k, (1 - mean) * k)


def bernoulli(p_steered: float, p_unsteered: float, icc: float = 0.0) -> Gen:
    """{0, 1} scores (thumbs up), user rates Beta-distributed around each arm's rate."""

    def gen(rng: np.random.Generator, arm: NDArray, users: NDArray) -> NDArray[np.float64]:
        p = _beta_means(rng, np.where(arm, p_steered, p_unsteered).astype(float), icc)
        return (rng.random(users.shape) < np.take_along_axis(p, users, 1)).astype(float)

    return gen


def uniform_users(lo_steered: float, lo_unsteered: float, width: float) -> Gen:
    """{0, 1} scores, each user's rate uniform on [lo, lo + width] of its arm (the acceptance
    logs: rate ~ U(0, 1) is Beta(1, 1), an ICC of 1/3)."""

    def gen(rng: np.random.Generator, arm: NDArray, users: NDArray) -> NDArray[np.float64]:
        p = np.where(arm, lo_steered, lo_unsteered) + width * rng.random(arm.shape)
        return (rng.random(users.shape) < np.take_along_axis(p, users, 1)).astype(float)

    return gen


def three_point(var_steered: float, var_unsteered: float) -> Gen:
    """Scores in {-1, 0, 1} with mean 0 and the given variances (P(+1) = P(-1) = var / 2),
    independent replies: equal means, unequal variances."""

    def gen(rng: np.random.Generator, arm: NDArray, users: NDArray) -> NDArray[np.float64]:
        v = np.take_along_axis(np.where(arm, var_steered, var_unsteered), users, 1)
        u = rng.random(users.shape)
        return np.where(u < v / 2, -1.0, np.where(u < v, 1.0, 0.0))

    return gen


def lognormal(median: float, sigma_user: float, sigma_reply: float) -> Gen:
    """A positive, skewed guardrail (latency in ms): log-normal per reply around a log-normal
    per-user level, the same in both arms."""

    def gen(rng: np.random.Generator, arm: NDArray, users: NDArray) -> NDArray[np.float64]:
        level = np.log(median) + sigma_user * rng.standard_normal(arm.shape)
        mu = np.take_along_axis(level, users, 1)
        return np.exp(mu + sigma_reply * rng.standard_normal(users.shape))

    return gen


@dataclass(frozen=True)
class Scenario:
    """One row of the suite: the traffic, and how many experiments are simulated."""

    n_users: int
    per_user: int
    split: float
    metrics: dict[str, Gen]
    n_languages: int = 1
    n_exp: int = 1000

    def run(self, seed: int) -> Sim:
        rng = np.random.default_rng(seed)
        return simulate(
            rng,
            self.n_exp,
            self.n_users,
            self.per_user,
            self.split,
            self.metrics,
            self.n_languages,
        )


#: A/A scenarios: both arms one distribution, so every winner called is a false one.
NULL = {
    "ICC 0 (100 users x 20)": Scenario(100, 20, 0.5, {"feedback": bernoulli(0.5, 0.5)}),
    "ICC 0.05 (100 x 20)": Scenario(100, 20, 0.5, {"feedback": bernoulli(0.5, 0.5, 0.05)}),
    "ICC 0.2 (100 x 20)": Scenario(100, 20, 0.5, {"feedback": bernoulli(0.5, 0.5, 0.2)}),
    "ICC 0.33 (100 x 20)": Scenario(100, 20, 0.5, {"feedback": bernoulli(0.5, 0.5, 1 / 3)}),
    "heavy users (40 x 50, p ~ Beta(1,1))": Scenario(
        40, 50, 0.5, {"feedback": uniform_users(0.0, 0.0, 1.0)}
    ),
    **{
        f"split {s} (var 1 vs 0.2, 500 x 4)": Scenario(
            500, 4, s, {"feedback": three_point(1.0, 0.2)}
        )
        for s in (0.1, 0.25, 0.5)
    },
    "latency guardrail (log-normal, 100 x 20)": Scenario(
        100, 20, 0.5, {"latency_ms": lognormal(800.0, 0.5, 0.3)}
    ),
    "5 languages x 3 metrics (200 x 10)": Scenario(
        200,
        10,
        0.5,
        {
            "feedback": bernoulli(0.5, 0.5, 0.1),
            "language_match": bernoulli(0.9, 0.9, 0.2),
            "pivot_leak": bernoulli(0.05, 0.05, 0.1),
        },
        n_languages=5,
        n_exp=300,
    ),
}

#: Scenarios with a true effect: power is the share of experiments in which the steered arm is
#: called (by the last reply, peeking at every one).
EFFECT = {
    "0.65 vs 0.5, independent (1000 users x 1)": Scenario(
        1000, 1, 0.5, {"feedback": bernoulli(0.65, 0.5)}, n_exp=1000
    ),
    "0.65 vs 0.5, clustered ICC 0.2 (200 x 5)": Scenario(
        200, 5, 0.5, {"feedback": bernoulli(0.65, 0.5, 0.2)}, n_exp=1000
    ),
    "0.55 vs 0.5, independent (4000 users x 1)": Scenario(
        4000, 1, 0.5, {"feedback": bernoulli(0.55, 0.5)}, n_exp=500
    ),
    "0.55 vs 0.5, clustered ICC 0.2 (800 x 5)": Scenario(
        800, 5, 0.5, {"feedback": bernoulli(0.55, 0.5, 0.2)}, n_exp=500
    ),
}


def write_log(path: str, sims: list[tuple[str, Sim]], metric: str = "feedback") -> None:
    """A decision log as ``steerserve serve --ab-log`` writes it: per reply of each experiment
    (named), a decision line (arm, subject hash, language "ja", a latency) and a feedback line
    with the reply's ``metric`` value as its score, in arrival order."""
    import json

    with open(path, "w") as f:
        t = 1.7e9
        for name, sim in sims:
            for e in range(sim.subjects.shape[0]):
                users, steered = sim.subjects[e], sim.steered[e]
                for j, score in enumerate(sim.values[metric][e]):
                    rid = f"{name}-{e}-{j}"
                    arm = "steered" if steered[j] else "unsteered"
                    t += 0.5
                    dec = {"type": "decision", "ts": round(t, 3), "id": rid}
                    dec |= {"experiment": f"{name}-{e}", "arm": arm, "language": "ja"}
                    dec |= {"subject_hash": f"u{users[j]}", "applied": bool(steered[j])}
                    dec |= {"latency_ms": 100.0}
                    f.write(json.dumps(dec) + "\n")
                    fb = {"type": "feedback", "ts": round(t + 0.1, 3), "id": rid, "score": score}
                    f.write(json.dumps(fb) + "\n")
