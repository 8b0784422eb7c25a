"""The gate rule of ``steerserve tune``, decided once on the confirmation half: an exact
one-sided sign test at α / k (a bootstrap of 40 binary items cannot resolve Bonferroni tails).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from steerserve.tune.scoring import paired_bootstrap

#: The rule in words, recorded in every tuned manifest beside its numbers.
RULE = (
    "a language opens (auto steers it at the calibrated scales, multiplier 1) only when, on the "
    "confirmation half (facts the calibration never saw), its steered answers beat its unsteered "
    "ones by an exact one-sided sign test (McNemar, wins vs losses) at level alpha / k "
    "(Bonferroni over the k non-English languages tested), English stays within its guards "
    "(accuracy and mean log P(gold) on the same half), and it has at least the items a "
    "confirmation needs to see the stated effect at 80 % power; the test split is run once "
    "afterwards and only reported"
)
POWER = 0.8


@dataclass(frozen=True)
class GateSettings:
    """The rule's knobs, recorded in the manifest with the decisions."""

    alpha: float = 0.05  # family-wise, one-sided
    min_effect: float = 0.3  # Δ accuracy the confirmation must be able to see (no losses)
    max_en_drop: float = 0.05  # English accuracy the vectors may cost on the confirmation half
    max_en_logp_drop: float = 0.1  # nats of English mean log P(gold)


def sign_test_p(wins: int, losses: int) -> float:
    """One-sided exact p of ``wins`` or more among ``wins + losses`` fair coin flips."""
    n = wins + losses
    if n == 0:
        return 1.0
    return sum(math.comb(n, i) for i in range(wins, n + 1)) / 2**n


def beyond_chance(wins: int, losses: int, k: int, alpha: float) -> bool:
    """More wins than losses than chance gives at level ``alpha / k`` (one-sided, exact)."""
    return wins > losses and sign_test_p(wins, losses) * k < alpha


def wins_needed(k: int, alpha: float) -> int:
    """The fewest wins (with no losses) that can reject at ``alpha / k``: below it no result
    could open a gate, whatever the steering did."""
    return max(1, math.ceil(math.log2(k / alpha)))


def _binom_tail(n: int, p: float, w: int) -> float:
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(w, n + 1))


def items_needed(k: int, alpha: float, min_effect: float, cap: int = 100_000) -> int:
    """The fewest confirmation items per language at which a true gain of ``min_effect`` with no
    losses (the best case, so a floor) confirms with power :data:`POWER`."""
    w = wins_needed(k, alpha)
    n = w
    while n < cap and _binom_tail(n, min_effect, w) < POWER:
        n += 1
    return n


def decide(
    base: Sequence[Mapping[str, Any]],
    steered: Sequence[Mapping[str, Any]],
    records: Sequence[Mapping[str, Any]],
    settings: GateSettings,
) -> dict[str, Any]:
    """Per language, the confirmation's numbers and the gate it earns (``open``, ``why``), from the
    runner's per-item results on the confirmation half, English the guard."""
    langs = sorted({r["lang"] for r in records} - {"en"})
    k = max(1, len(langs))
    floor, need = (
        wins_needed(k, settings.alpha),
        items_needed(k, settings.alpha, settings.min_effect),
    )
    guard = english_guard(base, steered, records, settings)
    out: dict[str, Any] = {}
    for lang in langs:
        idx = [i for i, r in enumerate(records) if r["lang"] == lang]
        b = [float(base[i]["correct"]) for i in idx]
        s = [float(steered[i]["correct"]) for i in idx]
        wins = sum(1 for x, y in zip(b, s, strict=True) if y > x)
        losses = sum(1 for x, y in zip(b, s, strict=True) if x > y)
        p = sign_test_p(wins, losses)
        acc = paired_bootstrap({lang: s}, {lang: b})
        lp = paired_bootstrap(
            {lang: [steered[i]["logp"] for i in idx]}, {lang: [base[i]["logp"] for i in idx]}
        )
        row = {
            "n": len(idx),
            "unsteered": round(sum(b) / len(b), 4),
            "steered": round(sum(s) / len(s), 4),
            "gain": round(acc["diff"], 4),
            "gain_ci95": [round(x, 4) for x in acc["ci95"]],
            "d_logp": round(lp["diff"], 4),
            "d_logp_ci95": [round(x, 4) for x in lp["ci95"]],
            "wins": wins,
            "losses": losses,
            "p_one_sided": round(p, 6),
            "p_bonferroni": round(min(1.0, p * k), 6),
        }
        row["open"], row["why"] = _verdict(row, guard, settings, k, floor, need)
        out[lang] = row
    return {
        "rule": RULE,
        "settings": settings.__dict__,
        "k": k,
        "items_needed": need,
        "wins_needed": floor,
        "english": guard,
        "languages": out,
    }


def _verdict(
    row: Mapping[str, Any],
    guard: Mapping[str, Any],
    s: GateSettings,
    k: int,
    floor: int,
    need: int,
) -> tuple[bool, str]:
    if row["n"] < need:
        return False, (
            f"closed: too few items ({row['n']} < {need} needed to see +{s.min_effect:g} "
            f"at {POWER:.0%} power, alpha {s.alpha:g}/{k})"
        )
    if not guard["ok"]:
        return False, f"closed: English outside its guard ({guard['why']})"
    if beyond_chance(row["wins"], row["losses"], k, s.alpha):
        return True, (
            f"open: {row['wins']} wins vs {row['losses']} losses, p {row['p_one_sided']:.2g} "
            f"< {s.alpha:g}/{k}"
        )
    return False, (
        f"closed: gain {row['gain']:+.3f} not beyond chance ({row['wins']} wins vs "
        f"{row['losses']} losses, p {row['p_one_sided']:.2g}, needs < {s.alpha:g}/{k})"
    )


def english_guard(
    base: Sequence[Mapping[str, Any]],
    steered: Sequence[Mapping[str, Any]],
    records: Sequence[Mapping[str, Any]],
    settings: GateSettings,
) -> dict[str, Any]:
    """Whether the vectors, applied to English, keep its accuracy and log P within bounds: a
    direction that damages English is not the language-independent one the method claims."""
    idx = [i for i, r in enumerate(records) if r["lang"] == "en"]
    if not idx:
        return {"ok": False, "n": 0, "why": "no English items on the confirmation half"}
    n = len(idx)
    d_acc = sum(float(steered[i]["correct"]) - float(base[i]["correct"]) for i in idx) / n
    d_logp = sum(steered[i]["logp"] - base[i]["logp"] for i in idx) / n
    why = []
    if d_acc < -settings.max_en_drop - 1e-9:
        why.append(f"accuracy {d_acc:+.3f} < -{settings.max_en_drop:g}")
    if d_logp < -settings.max_en_logp_drop - 1e-9:
        why.append(f"log P {d_logp:+.3f} nats < -{settings.max_en_logp_drop:g}")
    return {
        "ok": not why,
        "n": n,
        "d_accuracy": round(d_acc, 4),
        "d_logp": round(d_logp, 4),
        "why": "; ".join(why) or "within both guards",
    }


def manifest_languages(decision: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The manifest's ``languages`` object: every language tested, open ones at multiplier 1,
    each with its confirmation (a closed language is listed at 0, so ``auto`` says why)."""
    return {
        lang: {"multiplier": 1.0 if row["open"] else 0.0, "confirmation": dict(row)}
        for lang, row in decision["languages"].items()
    }
