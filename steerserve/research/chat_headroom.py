"""The chat form's headroom, measured through the engine with the whole-reply instrument.

How much could a vector recover on a chat model? The same facts, unsteered, under prompt
conditions that each supply one missing piece: earlier turns in the query language (the task),
earlier turns in English, and the English answer handed over with a request, written in the
query language, to write it in that language (conversion alone). The same facts asked in English
and in Chinese are the zero-shot condition's en and zh items. Every condition is scored by the
one scorer (first sentence, whole replies under a budget that fits) and every reply is kept.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from steerserve.research import evaluate as ev
from steerserve.research import reporting as R
from steerserve.research.facts import Fact, eval_records, load_facts, shots_for
from steerserve.research.facts.chat import INSTRUCTION, messages
from steerserve.research.replies import (
    CHAT_BUDGET,
    MAX_CUT_SHARE,
    BudgetError,
    check_cuts,
    judge,
    write_replies,
)
from steerserve.research.scoring import ArmResult, by_lang, non_english, paired_bootstrap, score_all

#: "How is «X» written in <the query language>?", asked in the query language itself.
TRANSLATE: dict[str, str] = {
    "en": "How do you write \u201c{x}\u201d in English?", "zh": "\u300c{x}\u300d用中文怎么写？",
    "ja": "\u300c{x}\u300dは日本語で何と書きますか？", "ko": "'{x}'의 한국어 표기는 무엇인가요?",
    "fr": "Comment écrit-on « {x} » en français ?", "es": "¿Cómo se escribe «{x}» en español?",
    "de": "Wie schreibt man \u201e{x}\u201c auf Deutsch?", "it": "Come si scrive «{x}» in italiano?",
    "ru": "Как пишется «{x}» по-русски?", "pt": "Como se escreve «{x}» em português?",
    "nl": "Hoe schrijf je \u2018{x}\u2019 in het Nederlands?", "ar": "كيف تُكتب «{x}» بالعربية؟",
}  # fmt: skip

BASE = "zero"


def _english_turns(fact: Fact, k: int, seed: int = 0) -> list[dict[str, str]]:
    """``k`` earlier turns of the English twins of the fact's demonstrations, then the question."""
    en = {f.fact_id: f for f in load_facts("train", ["en"], [fact.relation])}
    return messages(
        fact, k, seed, demos_from={d.fact_id: en[d.fact_id] for d in shots_for(fact, k, seed)}
    )


def _translate(fact: Fact) -> list[dict[str, str]]:
    """The English answer handed over, and the request to write it in the query language."""
    ask = TRANSLATE[fact.lang].format(x=fact.answers_en[0])
    return [{"role": "system", "content": INSTRUCTION[fact.lang]}, {"role": "user", "content": ask}]


#: Condition -> the chat of a fact under it.
CONDITIONS: dict[str, Callable[[Fact], list[dict[str, str]]]] = {
    BASE: lambda f: messages(f, 0),
    "native5": lambda f: messages(f, 5),
    "english5": lambda f: _english_turns(f, 5),
    "translate": _translate,
}


@dataclass
class Config:
    """One headroom run: which facts, which conditions, the engine and where it writes."""

    model_dir: Path
    out: Path
    split: str = "calib"
    part: tuple[int, int] = (0, 2)
    langs: tuple[str, ...] | None = None
    limit_per_lang: int | None = None
    conditions: tuple[str, ...] = tuple(CONDITIONS)
    max_tokens: int = CHAT_BUDGET
    max_cut_share: float = MAX_CUT_SHARE
    dtype: str = "auto"
    kv_cache_bytes: int = 2 << 30
    max_num_seqs: int = 128


def condition_records(cfg: Config) -> dict[str, list[dict]]:
    """The same items (ids, answers) under each condition; only the chat differs."""
    items = eval_records(
        cfg.split, langs=cfg.langs, limit_per_lang=cfg.limit_per_lang, part=cfg.part, form="chat"
    )
    facts = {f"{f.fact_id}:{f.lang}": f for f in load_facts(cfg.split, cfg.langs)}
    return {
        c: [{**r, "messages": CONDITIONS[c](facts[r["id"]])} for r in items] for c in cfg.conditions
    }


def conversion(records: Sequence[dict], results: Mapping[str, ArmResult]) -> dict[str, Any]:
    """Per non-English language: known in English (the twin's zero-shot answer), converted when
    handed the English name, and the addressable share: wrong zero-shot, yet known in English
    and converted."""
    base = results[BASE].correct
    twin = {
        r["id"].rsplit(":", 1)[0]: ok
        for r, ok in zip(records, base, strict=True)
        if r["lang"] == "en"
    }
    tr = results.get("translate")
    out: dict[str, Any] = {}
    for lang in dict.fromkeys(r["lang"] for r in records):
        if lang == "en":
            continue
        rows = [i for i, r in enumerate(records) if r["lang"] == lang]
        known = [twin.get(records[i]["id"].rsplit(":", 1)[0], False) for i in rows]
        conv = [tr.correct[i] for i in rows] if tr else [False] * len(rows)
        wrong = [not base[i] for i in rows]
        n = len(rows)
        out[lang] = {
            "n": n,
            "zero_shot": sum(base[i] for i in rows) / n,
            "known_in_english": sum(known) / n,
            "converted": sum(conv) / n,
            "addressable": sum(w and k and c for w, k, c in zip(wrong, known, conv, strict=True))
            / n,
        }
    return out


def conversion_md(conv: Mapping[str, Any]) -> list[str]:
    lines = ["", "## Conversion ceiling (non-English items, %)", ""]
    lines.append("| lang | n | zero-shot | same fact asked in English | handed the English name | "
                 "addressable: wrong, known in English, converted |")  # fmt: skip
    lines.append("|---|---|---|---|---|---|")
    for lang, c in conv.items():
        cells = [R.pct(c[k]) for k in ("zero_shot", "known_in_english", "converted", "addressable")]
        lines.append(f"| {lang} | {c['n']} | " + " | ".join(cells) + " |")
    return lines


def run(cfg: Config, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every condition through one engine, unsteered; report.json/md and replies.jsonl in
    ``cfg.out``. Raises :class:`BudgetError` (after writing) when the budget cut too many."""
    t0 = time.perf_counter()
    recs = condition_records(cfg)
    eng = ev.open_engine(cfg.model_dir, cfg.dtype, cfg.max_num_seqs, cfg.kv_cache_bytes)
    results: dict[str, ArmResult] = {}
    times: dict[str, float] = {}
    try:
        for cond, records in recs.items():
            t = time.perf_counter()
            gens = ev.generate(eng, ev.record_prompts(eng, records), [None] * len(records),
                               cfg.max_tokens, form="chat")  # fmt: skip
            res = score_all(records, [g.text for g in gens])
            res.replies = [judge(r, cond, g) for r, g in zip(records, gens, strict=True)]
            results[cond], times[cond] = res, round(time.perf_counter() - t, 1)
            log(f"{cond}: {len(records)} replies in {times[cond]} s")
    finally:
        eng.shutdown()
    first = next(iter(recs.values()))
    meta = {
        "model": cfg.model_dir.name,
        "dataset": f"built-in {cfg.split} split, part {cfg.part[0]}/{cfg.part[1]}, chat form",
        "n_items": len(first),
        "max_tokens": cfg.max_tokens,
        "conditions": list(recs),
        "config": {
            "split": cfg.split,
            "part": list(cfg.part),
            "langs": cfg.langs,
            "limit_per_lang": cfg.limit_per_lang,
        },  # fmt: skip
        "timings_s": {**times, "total": round(time.perf_counter() - t0, 1)},
    }
    report = ev.build_report(first, results, meta, base_arm=BASE)
    report["conversion"] = conversion(first, results)
    if "native5" in results and "english5" in results:
        nat = non_english(by_lang(first, results["native5"].correct))
        eng5 = non_english(by_lang(first, results["english5"].correct))
        report["native5_vs_english5"] = paired_bootstrap(nat, eng5)
    md = ev.report_markdown(report) + "\n".join(conversion_md(report["conversion"])) + "\n"
    write_replies(cfg.out / "replies.jsonl", ev.all_replies(results))
    R.write(cfg.out, report, md, {"accuracy.png": lambda p: ev.plot(report, p)})
    check_cuts([x.cut for x in ev.all_replies(results)], cfg.max_tokens, cfg.max_cut_share)
    return report


__all__ = ["BASE", "CONDITIONS", "TRANSLATE", "BudgetError", "Config", "condition_records", "run"]
