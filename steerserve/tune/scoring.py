"""The statistics of scored replies: per-language means first (every language weighs the same),
Wilson and bootstrap intervals, paired differences.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from steerserve.tune.scorer import score_record

if TYPE_CHECKING:
    from steerserve.tune.replies import Reply


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for k successes in n trials (well-behaved at 0 and n)."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, mid - half), min(1.0, mid + half))


def lang_mean(correct: Mapping[str, Sequence[float]]) -> float:
    return sum(sum(v) / len(v) for v in correct.values()) / len(correct) if correct else 0.0


def _boot_lang_means(
    values: Mapping[str, Sequence[float]], n_boot: int, seed: int
) -> Any:  # numpy [n_boot]
    """Bootstrap replicates of the mean over languages, items resampled within each language."""
    import numpy as np

    rng = np.random.default_rng(seed)
    acc = np.zeros(n_boot)
    for v in values.values():
        arr = np.asarray(v, dtype=float)
        acc += arr[rng.integers(0, len(arr), size=(n_boot, len(arr)))].mean(1)
    return acc / max(len(values), 1)


def bootstrap_mean(
    correct: Mapping[str, Sequence[float]], n_boot: int = 4000, seed: int = 0
) -> tuple[float, float]:
    """95 % interval of the mean of per-language accuracies, resampling items within languages."""
    import numpy as np

    reps = _boot_lang_means(correct, n_boot, seed)
    return (float(np.quantile(reps, 0.025)), float(np.quantile(reps, 0.975)))


def paired_bootstrap(
    a: Mapping[str, Sequence[float]],
    b: Mapping[str, Sequence[float]],
    n_boot: int = 4000,
    seed: int = 0,
) -> dict[str, Any]:
    """Difference of language-mean accuracy a - b on the same items, resampled jointly so item
    difficulty cancels: estimate, 95 % CI and ``p_le_0``, the share of differences <= 0."""
    import numpy as np

    d = {k: [x - y for x, y in zip(a[k], b[k], strict=True)] for k in a}
    reps = _boot_lang_means(d, n_boot, seed)
    return {
        "diff": lang_mean(a) - lang_mean(b),
        "ci95": [float(np.quantile(reps, 0.025)), float(np.quantile(reps, 0.975))],
        "p_le_0": float((reps <= 0).mean()),
    }


@dataclass
class ArmResult:
    """Per-item outcomes of one arm, in record order."""

    correct: list[bool] = field(default_factory=list)
    english: list[bool] = field(default_factory=list)
    recall_any: list[bool] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    chinese: list[bool] = field(default_factory=list)
    replies: list[Reply] = field(default_factory=list)  # every reply, kept (replies.jsonl)

    def extend(self, other: ArmResult, texts: bool = True) -> None:
        """Append ``other``'s items (their texts only if ``texts``; replies always)."""
        self.correct += other.correct
        self.english += other.english
        self.recall_any += other.recall_any
        self.chinese += other.chinese
        self.texts += other.texts if texts else []
        self.replies += other.replies


def score_all(records: Sequence[dict], texts: Sequence[str]) -> ArmResult:
    r = ArmResult(texts=list(texts))
    for rec, t in zip(records, texts, strict=True):
        s = score_record(rec, t)
        r.correct.append(s.correct)
        r.chinese.append(s.chinese)
        r.english.append(s.english)
        r.recall_any.append(s.recall_any)
    return r


def by_lang(records: Sequence[Mapping], values: Sequence[float]) -> dict[str, list[float]]:
    """``{lang: [value per item]}``, languages in first-seen order (bools count as 0/1)."""
    out: dict[str, list[float]] = {}
    for rec, v in zip(records, values, strict=True):
        out.setdefault(rec["lang"], []).append(float(v))
    return out


def non_english(d: Mapping[str, Sequence[float]]) -> dict[str, Sequence[float]]:
    """``d`` without English: the non-English means the verdicts are about."""
    return {k: v for k, v in d.items() if k != "en"}


#: The per-item results the transformers runner scores (``runner.Runner.run``).
METRICS: tuple[str, ...] = ("correct", "logp", "logp_tok", "english", "chinese", "recall_any")


def summarise(
    records: Sequence[Mapping],
    res: Sequence[Mapping],
    base: Sequence[Mapping] | None = None,
    keys: Sequence[str] = METRICS,
) -> dict[str, Any]:
    """Per language and non-English mean (with bootstrap 95 % CI) of every metric of runner
    results; with ``base`` (same items), paired differences with paired bootstrap CIs."""
    import numpy as np

    out: dict[str, Any] = {"n": len(res)}
    # results kept before "chinese" was scored lack it: only keys every side has
    for key in [k for k in keys if not res or (k in res[0] and (not base or k in base[0]))]:
        d = by_lang(records, [r[key] for r in res])
        ne = non_english(d)
        m: dict[str, Any] = {"per_lang": {k: float(np.mean(v)) for k, v in d.items()}}
        if ne:
            m["non_en"] = float(np.mean([np.mean(v) for v in ne.values()]))
            m["non_en_ci95"] = list(bootstrap_mean(ne))
        if base is not None:
            b = by_lang(records, [r[key] for r in base])
            if ne:
                m["diff_non_en"] = paired_bootstrap(ne, non_english(b))
            if "en" in d:
                m["diff_en"] = paired_bootstrap({"en": d["en"]}, {"en": b["en"]})
            m["diff_per_lang"] = {k: float(np.mean(v) - np.mean(b[k])) for k, v in d.items()}
        out[key] = m
    return out
