"""The prompt conditions the experiments compare, in both forms, and the train-fact pools
their vectors are averaged over.

Why one module: a condition ("5 English demonstrations, then the question") is the same idea in
the completion and the chat form; every experiment asks for it by name, so a new experiment
reuses the prompts the others were measured on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import cache
from typing import Any

import torch

from steerserve.research.extract import last_token_means, mixed_prompt, translation_chat
from steerserve.research.facts import ANSWER_SEP, Fact, load_facts, prompt, query, shots_for
from steerserve.research.facts.chat import messages

# "English" and the language's own name, written in the query language (conversion prompts).
ENGLISH_IN: dict[str, str] = {
    "en": "English", "zh": "英语", "ja": "英語", "ko": "영어", "fr": "Anglais", "es": "Inglés",
    "de": "Englisch", "it": "Inglese", "ru": "Английский", "pt": "Inglês", "nl": "Engels",
    "ar": "الإنجليزية",
}  # fmt: skip
SELF_NAME: dict[str, str] = {
    "en": "English", "zh": "中文", "ja": "日本語", "ko": "한국어", "fr": "Français",
    "es": "Español", "de": "Deutsch", "it": "Italiano", "ru": "Русский", "pt": "Português",
    "nl": "Nederlands", "ar": "العربية",
}  # fmt: skip


# --- prompt conditions (completion form) -------------------------------------------------------


def _label(lang: str, name: str, end: bool) -> str:
    """``name`` as a field label in the fact set's style: "英語：", "Anglais : ", "Inglés: "."""
    if lang in ("zh", "ja"):
        return name + "："
    colon = " :" if lang == "fr" else ":"
    return name + colon + ("" if end else " ")


def conversion_prompt(fact: Fact, shots: int = 3, seed: int = 0) -> str:
    """Explicit conversion, labels in the query language, the eval form's shots as demos.

    ja: ``英語：Tehran → 日本語：テヘラン\\n…英語：Amsterdam → 日本語：``; the model only has to
    write the English answer (given) in the query language: the conversion ceiling.
    """

    def line(en: str, lang: str) -> str:
        return (
            f"{_label(lang, ENGLISH_IN[lang], False)}{en} → {_label(lang, SELF_NAME[lang], True)}"
        )

    demos = [
        f"{line(s.answers_en[0], s.lang)}{ANSWER_SEP[s.lang]}{s.answers[0]}\n"
        for s in shots_for(fact, shots, seed)
    ]
    return "".join(demos) + line(fact.answers_en[0], fact.lang)


CONDITIONS: dict[str, Callable[[Fact, int], str]] = {
    "eval": lambda f, s: prompt(f, 3, s),  # (i) the evaluation form: 3-shot, query language
    "zero": lambda f, s: query(f),  # (ii) zero-shot
    "native5": lambda f, s: prompt(f, 5, s),  # (iii) 5 demonstrations in the query language
    "mixed5": lambda f, s: mixed_prompt(f, 5, s),  # (iv) 5 English demos, query-language question
    "convert": conversion_prompt,  # (vi) "English: <answer_en> → <language>:", 3-shot
}  # (v)/(vii), the same fact asked in English/Chinese, are the "eval" results of the twins


def mixed_messages(fact: Fact, k: int, seed: int = 0) -> list[dict[str, str]]:
    """Chat with ``k`` English demonstration turns, then the question in ``fact.lang``."""
    twins = {d.fact_id: fact_index(d.split)[f"{d.fact_id}:en"] for d in shots_for(fact, k, seed)}
    return messages(fact, k, seed, demos_from=twins)


def _chat_conditions() -> dict[str, Callable[[Fact, int], list[dict[str, str]]]]:
    return {
        "eval": lambda f, s: messages(f, 0, s),  # (i) the chat evaluation form: zero-shot
        "native5": lambda f, s: messages(f, 5, s),  # (iii) 5 earlier turns, query language
        "mixed5": lambda f, s: mixed_messages(f, 5, s),  # (iv) 5 English turns first
        "convert": lambda f, s: translation_chat(f, 0, s),  # (vi) "Translate into <lang>: X"
    }


def conditions(form: str) -> list[str]:
    """The prompt conditions of a form (a chat's evaluation form already is zero-shot)."""
    return list(CONDITIONS) if form == "completion" else list(_chat_conditions())


@cache
def fact_index(split: str) -> dict[str, Fact]:
    """``"<fact_id>:<lang>"`` -> Fact, the ids ``eval_records`` uses (shared: do not mutate)."""
    return {f"{f.fact_id}:{f.lang}": f for f in load_facts(split)}


def condition_records(items: Sequence[dict], facts: Mapping[str, Fact], cond: str, seed: int = 0):
    """``items`` (eval_records, either form) rewritten to condition ``cond``; answers kept."""
    out = []
    for r in items:
        f = facts[r["id"]]
        if "messages" in r:
            rec = {k: v for k, v in r.items() if k != "messages"}
            rec["messages"] = _chat_conditions()[cond](f, seed)
        else:
            rec = {**r, "prompt": CONDITIONS[cond](f, seed)}
        out.append(rec)
    return out


def eval_prompt(fact: Fact, form: str, seed: int = 0) -> str | list[dict[str, str]]:
    """The evaluation form of ``fact``: the completion's 3-shot prompt, or the zero-shot chat."""
    if form == "chat":
        return messages(fact, 0, seed)
    return prompt(fact, 3, seed)


def pooled_train_facts(langs: Sequence[str]) -> list[Fact]:
    """Every train fact once, in one of ``langs`` in turn (fact i in ``langs[i % n]``): a
    language-independent pool of distinct facts for vector means."""
    idx = fact_index("train")
    en = load_facts("train", ["en"])
    return [idx[f"{f.fact_id}:{langs[i % len(langs)]}"] for i, f in enumerate(en)]


def pooled_means(
    model: Any, tokenizer: Any, groups: Mapping[str, Sequence[Any]], batch_size: int = 16
) -> dict[str, torch.Tensor]:
    """Mean last-token block outputs ``[L, H]`` of each prompt group."""
    return {k: last_token_means(model, tokenizer, ps, batch_size, k)[0] for k, ps in groups.items()}


def form_prompt(fact: Fact, kind: str, form: str, seed: int = 0) -> Any:
    """``fact`` as a prompt of ``kind`` in ``form``: ``zero`` (zero-shot), ``eval`` (the
    evaluation form: 3-shot completion, zero-shot chat), ``native5``/``mixed5`` (5
    query-language / English demonstrations) or ``convert0`` (zero-shot explicit conversion)."""
    if form == "chat":
        return {
            "zero": lambda: messages(fact, 0, seed),
            "eval": lambda: messages(fact, 0, seed),
            "native5": lambda: messages(fact, 5, seed),
            "mixed5": lambda: mixed_messages(fact, 5, seed),
            "convert0": lambda: translation_chat(fact, 0, seed),
        }[kind]()
    return {
        "zero": lambda: query(fact),
        "eval": lambda: prompt(fact, 3, seed),
        "native5": lambda: prompt(fact, 5, seed),
        "mixed5": lambda: mixed_prompt(fact, 5, seed),
        "convert0": lambda: conversion_prompt(fact, 0, seed),
    }[kind]()


def as_prompt(p: Any) -> dict[str, Any]:
    """A prompt of either form as the record field that holds it."""
    return {"messages": p} if isinstance(p, list) else {"prompt": p}


def langs_of(items: Sequence[Mapping[str, Any]]) -> list[str]:
    """The languages of ``items``, in first-seen order."""
    return list(dict.fromkeys(r["lang"] for r in items))
