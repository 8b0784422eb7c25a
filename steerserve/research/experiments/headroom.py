"""Step 1, headroom without vectors: every prompt condition on the same items, paired against
the evaluation form.

Why first: a vector distilled from a prompt condition (demonstrations, asking in English, an
explicit conversion) can at most recover that condition's gain; scored by greedy accuracy and by
the teacher-forced log P of the gold query-language answer (max over aliases).
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from steerserve.research.cache import cached, slim
from steerserve.research.conditions import condition_records, conditions, langs_of
from steerserve.research.experiments.base import Context, Experiment, Plan, ci, split_part
from steerserve.research.facts import Fact
from steerserve.research.reporting import pct
from steerserve.research.runner import Runner
from steerserve.research.scoring import summarise

log = logging.getLogger("steerserve.research.headroom")


def first_per_lang(items: Sequence[Mapping[str, Any]], n: int | None) -> list[int]:
    """Indices of the first ``n`` items of each language (all with ``None``)."""
    seen: dict[str, int] = {}
    out = []
    for i, r in enumerate(items):
        seen[r["lang"]] = seen.get(r["lang"], 0) + 1
        if n is None or seen[r["lang"]] <= n:
            out.append(i)
    return out


def headroom(
    runner: Runner,
    items: Sequence[dict],
    facts: Mapping[str, Fact],
    seed: int = 0,
    partial: Path | None = None,
    limits: Mapping[str, int] | None = None,
):
    """Step 1: every prompt condition on the same items, no vectors; paired against ``eval``
    (a condition in ``limits`` on the first N items of each language only, paired on those).
    With ``partial``, each condition's per-item results are kept there (resumable)."""
    res: dict[str, list[dict]] = {}
    idx: dict[str, list[int]] = {}
    timing: dict[str, float] = {}
    for cond in conditions("chat" if "messages" in items[0] else "completion"):
        t0 = time.perf_counter()
        idx[cond] = first_per_lang(items, None if cond == "eval" else (limits or {}).get(cond))
        sub = [items[i] for i in idx[cond]]

        def run(cond: str = cond, sub: list[dict] = sub) -> list[dict]:
            return slim(runner.run(condition_records(sub, facts, cond, seed))[0][0])

        res[cond] = cached(None if partial is None else partial / f"{cond}.json", run)
        if len(res[cond]) == len(items) != len(sub):  # kept from a run without the limit
            idx[cond] = list(range(len(items)))
        if len(res[cond]) != len(idx[cond]):
            raise ValueError(f"{partial}/{cond}.json holds {len(res[cond])} results, not "
                             f"{len(idx[cond])}: it belongs to other items")  # fmt: skip
        timing[cond] = round(time.perf_counter() - t0, 1)
        log.info("headroom %s: %.0f s", cond, timing[cond])
    base = res["eval"]
    fid = [facts[r["id"]].fact_id for r in items]
    for twin_lang, name in (("en", "english"), ("zh", "chinese")):
        row = {
            f: i for i, (f, r) in enumerate(zip(fid, items, strict=True)) if r["lang"] == twin_lang
        }
        if row:  # (v) asked in English / (vii) asked in Chinese: the twin's eval-form result
            res[name], idx[name] = [base[row[f]] for f in fid], idx["eval"]
    out: dict[str, Any] = {
        "conditions": {
            c: summarise([items[i] for i in idx[c]], r, [base[i] for i in idx[c]])
            for c, r in res.items()
        },
        "n_items": {c: len(idx[c]) for c in res},
    }
    out["shares"] = _shares(items, res, idx)
    out["seconds"] = timing
    out["items"] = {c: slim(r) for c, r in res.items() if c not in ("english", "chinese")}
    out["ids"] = {c: [items[i]["id"] for i in idx[c]] for c in res}
    return out


def _shares(items: Sequence[dict], res: Mapping[str, list[dict]], idx: Mapping[str, list[int]]):
    """What each ceiling could add, counted on the evaluation form's answers: the shares of
    items answered right when asked in the pivot language (English, Chinese), converted right
    when given the English answer, and both among the evaluation form's wrong answers."""
    base, conv, twin = res["eval"], res["convert"], res["english"]
    if idx["convert"] != idx["eval"]:
        raise ValueError("the conversion condition must run on every item")
    sets = {
        "eval_correct": [b["correct"] for b in base],
        "recall_any": [b["recall_any"] for b in base],
        "known_en": [t["correct"] for t in twin],
        "converts": [c["correct"] for c in conv],
        "known_en_and_converts": [t["correct"] and c["correct"] for t, c in zip(twin, conv, strict=True)],
        "wrong_but_known_en": [t["correct"] and not b["correct"] for t, b in zip(twin, base, strict=True)],
        "wrong_but_known_en_and_converts": [
            t["correct"] and c["correct"] and not b["correct"]
            for t, c, b in zip(twin, conv, base, strict=True)
        ],
    }  # fmt: skip
    if "chinese" in res:
        zh = res["chinese"]
        sets["known_zh"] = [t["correct"] for t in zh]
        sets["wrong_but_known_zh"] = [
            t["correct"] and not b["correct"] for t, b in zip(zh, base, strict=True)
        ]
    return {
        k: {**summarise(items, [{"v": float(x)} for x in v], None, ("v",))["v"]}
        for k, v in sets.items()
    }


WHAT: dict[str, str] = {
    "eval": "(i) eval form: 3-shot, query language",
    "zero": "(ii) zero-shot query",
    "native5": "(iii) 5 query-language demonstrations",
    "mixed5": "(iv) 5 English demonstrations, query-language question",
    "english": "(v) same fact asked in English (English answer scored)",
    "chinese": "(vii) same fact asked in Chinese (Chinese answer scored)",
    "convert": "(vi) explicit conversion, 3-shot, labels in the query language",
}


def headroom_md(h: Mapping[str, Any]) -> list[str]:
    c = h["conditions"]
    zh = "chinese" in c["eval"]
    lines = [
        "| condition | N | non-English acc % [95 % CI] | Δ acc vs (i), pts [paired CI] | mean log "
        "P(gold) | Δ log P [paired CI] | Δ log P / token [paired CI] | English acc % | recall-any "
        "% | answered in English %" + (" | answered in Chinese % |" if zh else " |"),
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if zh else ""),
    ]
    for name, s in c.items():
        acc, lp, lpt = s["correct"], s["logp"], s["logp_tok"]
        lo, hi = acc["non_en_ci95"]
        row = [
            WHAT.get(name, name),
            str(h.get("n_items", {}).get(name, s["n"])),
            f"{pct(acc['non_en'])} [{pct(lo)}, {pct(hi)}]",
            ci(acc["diff_non_en"]) if name != "eval" else "—",
            f"{lp['non_en']:.2f}",
            ci(lp["diff_non_en"], 1, "{:+.2f}") if name != "eval" else "—",
            ci(lpt["diff_non_en"], 1, "{:+.2f}") if name != "eval" else "—",
            pct(acc["per_lang"].get("en")),
            pct(s["recall_any"]["non_en"]),
            pct(s["english"]["non_en"]),
        ] + ([pct(s["chinese"]["non_en"])] if zh else [])
        lines.append("| " + " | ".join(row) + " |")
    langs = list(c["eval"]["correct"]["per_lang"])
    lines += ["", "Accuracy % per language:", ""]
    lines += ["| condition | " + " | ".join(langs) + " |", "|---" * (len(langs) + 1) + "|"]
    for name, s in c.items():
        pl = s["correct"]["per_lang"]
        lines.append(f"| {name} | " + " | ".join(pct(pl.get(g)) for g in langs) + " |")
    lines += ["", "Mean teacher-forced log P(gold) per language (nats):", ""]
    lines += ["| condition | " + " | ".join(langs) + " |", "|---" * (len(langs) + 1) + "|"]
    for name, s in c.items():
        pl = s["logp"]["per_lang"]
        cells = [f"{pl[g]:.2f}" if pl.get(g) is not None else "—" for g in langs]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Shares of the non-English items (language mean, bootstrap 95 % CI):", ""]
    lines += ["| set | % [CI] |", "|---|---|"]
    for k, s in h["shares"].items():
        lo, hi = s["non_en_ci95"]
        lines.append(f"| {k} | {pct(s['non_en'])} [{pct(lo)}, {pct(hi)}] |")
    return lines


def _options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--part",
        type=split_part,
        default=(0, 1),
        help="headroom items: k/n = every n-th fact from the k-th",
    )
    p.add_argument("--limit-per-lang", type=int, default=None, help="headroom items per language")
    p.add_argument(
        "--demo-limit",
        type=int,
        default=None,
        help="run the 5-demonstration conditions (native5, mixed5) on the first N items per "
        "language only (long prompts; paired against the evaluation form on those items)",
    )


def _plan(ctx: Context) -> Plan:
    a = ctx.args
    items = ctx.records(a.part, a.limit_per_lang)
    setup = f"{len(items)} items ({ctx.describe(a.part)}; languages {', '.join(langs_of(items))})."
    return Plan(f"headroom@{a.part[0]}of{a.part[1]}", setup, {"items": items})


def _run(ctx: Context, plan: Plan) -> dict[str, Any]:
    a = ctx.args
    lim = {c: a.demo_limit for c in ("native5", "mixed5")} if a.demo_limit else None
    items = plan.inputs["items"]
    return headroom(ctx.runner, items, ctx.facts, a.seed, ctx.partial(plan.key), lim)


EXPERIMENT = Experiment(
    "headroom", "Step 1: headroom without vectors", _plan, _run, headroom_md, (_options,)
)
