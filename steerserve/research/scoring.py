"""Scoring answers and the statistics of accuracies, shared by calibration, evaluation and the
diagnosis.

The answer is the first line of a greedy reply. A **completion** record's answer is correct when
its normalised text *starts with* a normalised gold answer in the query language (a base model
continues "Capital:" with the name); a **chat** record's when a normalised gold answer *occurs
in* it (an assistant may say "The capital of France is Paris."). Normalising: NFKC, casefold,
punctuation and whitespace removed. Accuracies are averaged per language first, then over
languages, so every language weighs the same.

Wrong answers are also classed by language, the two likely pivots of a multilingual model
(``RULES`` states each rule; the reports repeat it):

- ``english``: completion: starts with an English gold name; chat: contains one, or, when the
  query language's answers are not in Latin script, is mostly Latin letters.
- ``chinese``: contains the fact's Chinese answer (``answers_zh``), or has Han characters and
  no kana or Hangul (for Japanese queries a kanji-only wrong answer counts as Chinese).
"""

from __future__ import annotations

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


def contains(pred: str, answers: Iterable[str]) -> bool:
    """True if some normalised (non-empty) answer occurs in the normalised prediction."""
    p = normalise(pred)
    return any(a and a in p for a in map(normalise, answers))


def _is_latin(ch: str) -> bool:
    return ch.isalpha() and unicodedata.name(ch, "").startswith("LATIN")


def latin_share(text: str) -> float:
    """Share of the letters of ``text`` that are Latin (0 when it has none)."""
    letters = [c for c in text if c.isalpha()]
    return sum(map(_is_latin, letters)) / len(letters) if letters else 0.0


def _han(c: str) -> bool:
    return "\u4e00" <= c <= "\u9fff" or "\u3400" <= c <= "\u4dbf" or "\uf900" <= c <= "\ufaff"


def _kana(c: str) -> bool:
    return "\u3040" <= c <= "\u30ff" or "\u31f0" <= c <= "\u31ff" or "\uff66" <= c <= "\uff9f"


def _hangul(c: str) -> bool:
    return "\uac00" <= c <= "\ud7a3" or "\u1100" <= c <= "\u11ff" or "\u3130" <= c <= "\u318f"


def looks_chinese(text: str) -> bool:
    """Han characters and neither kana nor Hangul: Chinese rather than Japanese or Korean."""
    return any(map(_han, text)) and not any(_kana(c) or _hangul(c) for c in text)


RULES: dict[str, str] = {
    "correct.completion": "first line, normalised (NFKC, casefold, no punctuation or "
    "whitespace), starts with a normalised accepted answer",
    "correct.chat": "first line, normalised, contains a normalised accepted answer",
    "english.completion": "wrong, and starts with an English answer (answers_en)",
    "english.chat": "wrong, and contains an English answer, or is mostly Latin letters when "
    "the query language's answers are not in Latin script",
    "chinese": "query language not zh, wrong, and contains the Chinese answer (answers_zh) or "
    "has Han characters and no kana or Hangul",
}


@dataclass(frozen=True)
class Score:
    correct: bool
    english: bool  # answered in English (the English name) instead of the query language
    recall_any: bool  # correct in the query language or in English
    chinese: bool = False  # answered in Chinese instead of the query language


def score(
    continuation: str,
    answers: Sequence[str],
    answers_en: Sequence[str] = (),
    *,
    chat: bool = False,
    lang: str | None = None,
    answers_zh: Sequence[str] = (),
) -> Score:
    """Score one reply (see the module docstring); ``chat`` selects the chat rules."""
    pred = first_line(continuation)
    hit = contains if chat else matches
    ok = hit(pred, answers)
    in_en = hit(pred, answers_en)
    en = not ok and (in_en or (chat and _latin_reply(pred, answers)))
    zh = not ok and lang != "zh" and (hit(pred, answers_zh) or looks_chinese(pred))
    return Score(ok, bool(en), ok or in_en, bool(zh))


def _latin_reply(pred: str, answers: Sequence[str]) -> bool:
    """A mostly Latin reply to a question whose answers are not Latin script."""
    return latin_share(pred) > 0.5 and not any(latin_share(a) > 0.5 for a in answers)


def score_record(rec: Mapping[str, Any], text: str) -> Score:
    """:func:`score` with the record's form, language and answers."""
    return score(
        text,
        rec["answers"],
        rec.get("answers_en", ()),
        chat="messages" in rec,
        lang=rec.get("lang"),
        answers_zh=rec.get("answers_zh", ()),
    )


def rules(chat: bool) -> dict[str, str]:
    """The rules a report on records of this form was scored by."""
    form = "chat" if chat else "completion"
    return {
        "correct": RULES[f"correct.{form}"],
        "english": RULES[f"english.{form}"],
        "chinese": RULES["chinese"],
    }


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
    chinese: list[bool] = field(default_factory=list)

    def extend(self, other: ArmResult, texts: bool = True) -> None:
        """Append ``other``'s items (their texts only if ``texts``)."""
        self.correct += other.correct
        self.english += other.english
        self.recall_any += other.recall_any
        self.chinese += other.chinese
        self.texts += other.texts if texts else []


def score_all(records: Sequence[dict], texts: Sequence[str]) -> ArmResult:
    r = ArmResult(texts=list(texts))
    for rec, t in zip(records, texts, strict=True):
        s = score_record(rec, t)
        r.correct.append(s.correct)
        r.chinese.append(s.chinese)
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
    """JSONL records of either form, checked (see :mod:`steerserve.research.records`)."""
    from steerserve.research.records import read_dataset as read

    return read(path)
