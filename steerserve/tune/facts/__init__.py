"""The multilingual fact set and its evaluation records.

The data (facts, splits, prompts) is ``facts.dataset``; the chat form's messages are
``facts.chat``; this package joins them into records of the ``eval --dataset`` schema (kept here,
above both, so neither imports the other's parent).
"""

from __future__ import annotations

from collections.abc import Iterable

from steerserve.tune.facts.chat import messages
from steerserve.tune.facts.dataset import (
    ANSWER_SEP,
    DATA,
    FORMS,
    LANGS,
    PAPER_LANGS,
    RELATIONS,
    SPLITS,
    TEMPLATES,
    Fact,
    _round_robin,
    default_shots,
    load_facts,
    prompt,
    query,
    shot,
    shots_for,
)


def eval_records(
    split: str = "test",
    shots: int | None = None,
    seed: int = 0,
    langs: Iterable[str] | None = None,
    relations: Iterable[str] | None = None,
    limit_per_lang: int | None = None,
    part: tuple[int, int] = (0, 1),
    form: str = "completion",
) -> list[dict]:
    """Evaluation items in the ``eval --dataset`` schema, grouped by language.

    Facts of a language are listed with relations interleaved, better-known entities first.
    ``part=(k, n)`` keeps every n-th fact of each relation from the k-th on (``(0, 2)`` and
    ``(1, 2)`` are two disjoint halves alike in relations and familiarity); ``limit_per_lang`` then
    takes the first N. ``form``: ``completion`` records hold a ``shots``-shot ``prompt`` (default
    3); ``chat`` records hold ``messages`` (``facts.chat``: zero-shot by default, earlier turns as
    demonstrations otherwise) and ``answers_zh``, the Chinese answer of the same fact (a likely
    pivot language), for the same facts and splits.
    """
    if form not in FORMS:
        raise ValueError(f"unknown form {form!r}; known: {', '.join(FORMS)}")
    shots = default_shots(form, shots)
    facts = load_facts(split, langs, relations)
    zh = {f.fact_id: list(f.answers) for f in load_facts(split, ["zh"], relations)}
    out: list[dict] = []
    for lang in dict.fromkeys(f.lang for f in facts):
        chosen = _round_robin([f for f in facts if f.lang == lang], part)
        for f in chosen if limit_per_lang is None else chosen[:limit_per_lang]:
            rec: dict = {"id": f"{f.fact_id}:{f.lang}", "lang": f.lang}
            if form == "chat":
                rec["messages"] = messages(f, shots, seed)
            else:
                rec["prompt"] = prompt(f, shots, seed)
            rec |= {"answers": list(f.answers), "answers_en": list(f.answers_en)}
            if form == "chat":
                rec["answers_zh"] = zh[f.fact_id]
            out.append(rec)
    return out
