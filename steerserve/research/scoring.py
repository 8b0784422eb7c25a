"""Scoring answers and the statistics of accuracies, shared by calibration, evaluation and the
diagnosis.

An answer is the first line of a greedy continuation; it is correct when its normalised text
starts with a normalised gold answer in the query language. Answers that match an English gold
name instead count toward ``english_rate`` (a conversion failure). Accuracies are averaged per
language first, then over languages, so every language weighs the same.
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_PUNCT = re.compile(r"[\s\W_]+", re.UNICODE)


def normalise(text: str) -> str:
    """NFKC, casefold, drop punctuation and whitespace: "  París." == "parís"."""
    return _PUNCT.sub("", unicodedata.normalize("NFKC", text).casefold())


def first_line(text: str) -> str:
    """The answer is the first non-empty-prefix line: ``" Paris\\nCountry: ..."`` -> ``"Paris"``."""
    return text.lstrip(" \t").split("\n", 1)[0].strip()


def matches(pred: str, answers: Iterable[str]) -> bool:
    """True if the normalised prediction starts with some normalised (non-empty) answer."""
    p = normalise(pred)
    return any(a and p.startswith(a) for a in map(normalise, answers))


@dataclass(frozen=True)
class Score:
    correct: bool
    english: bool  # answered with the English name instead of the query language's
    recall_any: bool  # correct in the query language or in English


def score(continuation: str, answers: Sequence[str], answers_en: Sequence[str] = ()) -> Score:
    pred = first_line(continuation)
    ok = matches(pred, answers)
    en = (not ok) and matches(pred, answers_en)
    return Score(ok, en, ok or en)


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
    """Difference of language-mean accuracy a - b on the same items: estimate, 95 % CI, p.

    Items are resampled jointly (paired), so item difficulty cancels and the interval is the
    honest test of "a beats b"; ``p_le_0`` is the bootstrap share of differences <= 0.
    """
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

    def extend(self, other: ArmResult, texts: bool = True) -> None:
        """Append ``other``'s items (their texts only if ``texts``)."""
        self.correct += other.correct
        self.english += other.english
        self.recall_any += other.recall_any
        self.texts += other.texts if texts else []


def score_all(records: Sequence[dict], texts: Sequence[str]) -> ArmResult:
    r = ArmResult(texts=list(texts))
    for rec, t in zip(records, texts, strict=True):
        s = score(t, rec["answers"], rec.get("answers_en", ()))
        r.correct.append(s.correct)
        r.english.append(s.english)
        r.recall_any.append(s.recall_any)
    return r


def by_lang(records: Sequence[dict], values: Sequence[bool]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for rec, v in zip(records, values, strict=True):
        out.setdefault(rec["lang"], []).append(float(v))
    return out


def non_english(d: Mapping[str, Sequence[float]]) -> dict[str, Sequence[float]]:
    return {k: v for k, v in d.items() if k != "en"}


def read_dataset(path: str | Path) -> list[dict]:
    """JSONL records ``{"id","lang","prompt","answers","answers_en"?}``; checked, not trusted."""
    out = []
    for i, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        r = json.loads(line)
        missing = {"id", "lang", "prompt", "answers"} - set(r)
        if missing:
            raise ValueError(f"{path}:{i}: missing {sorted(missing)}")
        if not isinstance(r["answers"], list) or not r["answers"]:
            raise ValueError(f"{path}:{i}: answers must be a non-empty list")
        r.setdefault("answers_en", [])
        out.append(r)
    if not out:
        raise ValueError(f"{path}: no records")
    return out
