"""The multilingual fact set and its evaluation records: ``dataset`` holds the data, ``chat``
the chat form; this package joins them (above both, so neither imports the other's parent).
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
    """Evaluation items in the ``eval --dataset`` schema by language: ``part=(k, n)`` keeps every
    n-th fact of each relation from the k-th (disjoint halves alike), in ``form``."""
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
