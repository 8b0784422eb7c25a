"""The fact set's data: CLDR-derived facts, their splits and few-shot prompts; prompts are
infobox labels ("Country: France. Capital:"), so subjects need no article or case.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

LANGS: tuple[str, ...] = ("en", "zh", "ja", "ko", "fr", "es", "de", "it", "ru", "pt", "nl", "ar")
RELATIONS: tuple[str, ...] = ("capital_of", "city_in", "language_of", "currency_of")
PAPER_LANGS: tuple[str, ...] = ("en", "zh", "ja", "ko", "fr", "es")
SPLITS: tuple[str, ...] = ("train", "calib", "test")
#: Prompt forms: few-shot text continuation (base models) or a chat (instruction-tuned models).
FORMS: tuple[str, ...] = ("completion", "chat")
DATA = Path(__file__).with_name("facts.jsonl")

# What follows the query before the answer ("Capital: Paris", "首都：巴黎").
ANSWER_SEP: dict[str, str] = {lang: "" if lang in ("zh", "ja") else " " for lang in LANGS}

_COUNTRY = {
    "en": "Country: {s}.", "zh": "国家：{s}。", "ja": "国：{s}。", "ko": "국가: {s}.",
    "fr": "Pays : {s}.", "es": "País: {s}.", "de": "Land: {s}.", "it": "Paese: {s}.",
    "ru": "Страна: {s}.", "pt": "País: {s}.", "nl": "Land: {s}.", "ar": "الدولة: {s}.",
}  # fmt: skip
_CITY = {
    "en": "City: {s}.", "zh": "城市：{s}。", "ja": "都市：{s}。", "ko": "도시: {s}.",
    "fr": "Ville : {s}.", "es": "Ciudad: {s}.", "de": "Stadt: {s}.", "it": "Città: {s}.",
    "ru": "Город: {s}.", "pt": "Cidade: {s}.", "nl": "Stad: {s}.", "ar": "المدينة: {s}.",
}  # fmt: skip
_ATTRIBUTE = {
    "capital_of": {
        "en": "Capital:", "zh": "首都：", "ja": "首都：", "ko": "수도:", "fr": "Capitale :",
        "es": "Capital:", "de": "Hauptstadt:", "it": "Capitale:", "ru": "Столица:",
        "pt": "Capital:", "nl": "Hoofdstad:", "ar": "العاصمة:",
    },
    "city_in": {
        "en": "Country:", "zh": "国家：", "ja": "国：", "ko": "국가:", "fr": "Pays :",
        "es": "País:", "de": "Land:", "it": "Paese:", "ru": "Страна:", "pt": "País:",
        "nl": "Land:", "ar": "الدولة:",
    },
    "language_of": {
        "en": "Official language:", "zh": "官方语言：", "ja": "公用語：", "ko": "공용어:",
        "fr": "Langue officielle :", "es": "Idioma oficial:", "de": "Amtssprache:",
        "it": "Lingua ufficiale:", "ru": "Официальный язык:", "pt": "Língua oficial:",
        "nl": "Officiële taal:", "ar": "اللغة الرسمية:",
    },
    "currency_of": {
        "en": "Currency:", "zh": "货币：", "ja": "通貨：", "ko": "통화:", "fr": "Monnaie :",
        "es": "Moneda:", "de": "Währung:", "it": "Valuta:", "ru": "Валюта:", "pt": "Moeda:",
        "nl": "Valuta:", "ar": "العملة:",
    },
}  # fmt: skip


def _template(relation: str, lang: str) -> str:
    subject = _CITY if relation == "city_in" else _COUNTRY
    gap = "" if lang in ("zh", "ja") else " "
    return subject[lang] + gap + _ATTRIBUTE[relation][lang]


TEMPLATES: dict[str, dict[str, str]] = {
    rel: {lang: _template(rel, lang) for lang in LANGS} for rel in RELATIONS
}


@dataclass(frozen=True)
class Fact:
    """One fact in one language; ``fact_id`` is shared by its translations."""

    fact_id: str
    relation: str
    lang: str
    subject: str
    answers: tuple[str, ...]
    answers_en: tuple[str, ...]
    split: str


@cache
def _all() -> tuple[Fact, ...]:
    facts = []
    with DATA.open(encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            r["answers"] = tuple(r["answers"])
            r["answers_en"] = tuple(r["answers_en"])
            facts.append(Fact(**r))
    return tuple(facts)


def _check(kind: str, given: Iterable[str] | None, known: tuple[str, ...]) -> set[str] | None:
    if given is None:
        return None
    given = {given} if isinstance(given, str) else set(given)
    unknown = given - set(known)
    if unknown:
        raise ValueError(f"unknown {kind} {sorted(unknown)}; known: {', '.join(known)}")
    return given


def load_facts(
    split: str | None = None,
    langs: Iterable[str] | None = None,
    relations: Iterable[str] | None = None,
) -> list[Fact]:
    """Facts filtered by split, languages and relations (None: all), in file order."""
    splits = _check("split", split, SPLITS)
    lang_set = _check("language", langs, LANGS)
    rel_set = _check("relation", relations, RELATIONS)
    return [
        f
        for f in _all()
        if (splits is None or f.split in splits)
        and (lang_set is None or f.lang in lang_set)
        and (rel_set is None or f.relation in rel_set)
    ]


def query(fact: Fact) -> str:
    """Zero-shot query in ``fact.lang``; ends where the answer (after ANSWER_SEP) starts."""
    return TEMPLATES[fact.relation][fact.lang].format(s=fact.subject)


def shot(fact: Fact) -> str:
    """One demonstration line: the query, its answer, a newline."""
    return f"{query(fact)}{ANSWER_SEP[fact.lang]}{fact.answers[0]}\n"


@cache
def _train_pool(relation: str, lang: str) -> tuple[Fact, ...]:
    return tuple(load_facts("train", [lang], [relation]))


def shots_for(fact: Fact, k: int, seed: int = 0) -> list[Fact]:
    """``k`` train facts of the same relation and language, never ``fact``, chosen by fact id so
    translations get the same shots; shots giving the answer away only when nothing else is left."""
    pool = [f for f in _train_pool(fact.relation, fact.lang) if f.fact_id != fact.fact_id]
    random.Random(f"{seed}|{fact.fact_id}").shuffle(pool)
    chosen: list[Fact] = []
    used = {fact.answers_en[0]}
    for f in pool:
        if len(chosen) < k and f.answers_en[0] not in used:
            chosen.append(f)
            used.add(f.answers_en[0])
    for f in pool:
        if len(chosen) < k and f not in chosen:
            chosen.append(f)
    return chosen


def prompt(fact: Fact, shots: int = 3, seed: int = 0) -> str:
    """A ``shots``-shot prompt in ``fact.lang``, ending with ``query(fact)``."""
    return "".join(shot(s) for s in shots_for(fact, shots, seed)) + query(fact)


def _round_robin(facts: list[Fact], part: tuple[int, int] = (0, 1)) -> list[Fact]:
    """Interleave relations so a per-language limit keeps every relation represented; ``part``
    keeps every n-th fact of each relation from the k-th on."""
    by_rel: dict[str, list[Fact]] = {}
    for f in facts:
        by_rel.setdefault(f.relation, []).append(f)
    out: list[Fact] = []
    queues = [by_rel[r][part[0] :: part[1]] for r in RELATIONS if r in by_rel]
    for i in range(max((len(q) for q in queues), default=0)):
        out += [q[i] for q in queues if i < len(q)]
    return out


def default_shots(form: str, shots: int | None = None) -> int:
    """``shots``, else the form's default: 3 demonstrations for a completion (a base model needs
    the pattern), none for a chat (an instruction-tuned model is asked directly)."""
    return (3 if form == "completion" else 0) if shots is None else shots
