"""Step 3b, the translation difference vector: mean(explicit conversion prompts) minus
mean(recall prompts) of the same train facts, added in natural units.

Why: when the model knows the English answer but fails to write it in the query language (a
conversion failure, ``analyze.classify``), the conversion prompts' state difference is the
direction that should help; judged on all items and on those failures.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from steerserve.research.analyze import answer_sep, best_rank, classify, first_tokens, lens_head
from steerserve.research.cache import cached, cached_tensors, slim_steps
from steerserve.research.conditions import as_prompt, form_prompt, pooled_means, pooled_train_facts
from steerserve.research.experiments import selection
from steerserve.research.experiments.base import Context, Experiment, Plan, floats, ints
from steerserve.research.experiments.selection import confirm_md
from steerserve.research.facts import Fact
from steerserve.research.runner import Edit, Runner
from steerserve.research.scoring import compact, summarise


def conversion_failures(runner: Runner, recs: Sequence[dict], res: Sequence[dict], states):
    """The diagnosis' class of every item (``analyze.classify``: a wrong answer whose English
    answer reached rank <= 10 at the last prompt token in the second half of the blocks is a
    conversion failure, else a recall failure), from the captured unedited states."""
    head = lens_head(runner.model)
    n = runner.num_layers
    out = []
    for rec, r, h in zip(recs, res, states, strict=True):
        if r["correct"]:
            out.append("correct")
            continue
        sep = answer_sep(rec, runner.tok)
        toks = first_tokens(runner.tok, rec.get("prompt"), sep, rec["answers_en"])
        ranks, _ = best_rank(head(h.to(runner.dev)).cpu(), toks)
        out.append(classify(False, np.concatenate([[np.nan], ranks]), n // 2, n - 1, 10))
    return out


def translation(
    runner: Runner,
    sel: Sequence[dict],
    conf: Sequence[dict],
    facts: Mapping[str, Fact],
    layers: Sequence[int],
    scales: Sequence[float],
    top: int = 3,
    seed: int = 0,
    partial: Path | None = None,
) -> dict[str, Any]:
    """Step 3b: d = mean(zero-shot explicit conversion prompts) - mean(zero-shot recall
    prompts) of the same ~200 train facts (languages pooled), added in natural units (scale x
    the raw difference) at the last prompt token and every later token of the eval form;
    judged on all items and on the diagnosis' conversion failures."""
    form = "chat" if "messages" in sel[0] else "completion"
    p = (lambda n: None) if partial is None else (lambda n: partial / n)  # noqa: E731
    langs = sorted({r["lang"] for r in sel} - {"en"})
    pool = pooled_train_facts(langs)
    groups = {k: [form_prompt(f, k, form, seed) for f in pool] for k in ("convert0", "zero")}
    means = cached_tensors(p("means.pt"), lambda: pooled_means(runner.model, runner.tok, groups))
    d = means["convert0"] - means["zero"]
    edits = [
        Edit.of(f"tr{s}@{ly}", ly, "add", d[ly], s, positions="last_prompt_and_generated")
        for ly in layers
        for s in scales
    ]
    recs = [{**r, **as_prompt(form_prompt(facts[r["id"]], "eval", form, seed))} for r in sel]

    def select() -> dict[str, Any]:
        res, states = runner.run(recs, [None, *edits], capture=True)
        return {"res": slim_steps(res), "cls": conversion_failures(runner, recs, res[0], states)}

    got = cached(p("select.json"), select)
    res, cls = got["res"], got["cls"]
    conv = [i for i, c in enumerate(cls) if c == "conversion" and recs[i]["lang"] != "en"]
    sub = [recs[i] for i in conv]
    out: dict[str, Any] = {
        "d_norm": [round(float(x.norm()), 1) for x in d],
        "classes": {c: cls.count(c) for c in sorted(set(cls))},
        "all": {
            e.name: compact(summarise(recs, r, res[0])) for e, r in zip(edits, res[1:], strict=True)
        },
        "conversion": {
            e.name: compact(summarise(sub, [r[i] for i in conv], [res[0][i] for i in conv]))
            for e, r in zip(edits, res[1:], strict=True)
        }
        if conv
        else {},
        "n_select": len(recs),
        "n_conversion": len(conv),
    }
    best = sorted(out["all"], key=lambda n: -out["all"][n]["d_logp"])[:top]
    chosen = [e for e in edits if e.name in best]
    rc = [{**r, **as_prompt(form_prompt(facts[r["id"]], "eval", form, seed))} for r in conf]
    cres = cached(
        p(f"confirm-{'+'.join(best)}.json"),
        lambda: slim_steps(runner.run(rc, [None, *chosen])[0]),
    )
    out["chosen"] = best
    out["confirmation"] = {
        e.name: summarise(rc, r, cres[0]) for e, r in zip(chosen, cres[1:], strict=True)
    }
    out["confirmation_base"] = summarise(rc, cres[0])
    out["n_confirm"] = len(rc)
    return out


def translation_md(t: Mapping[str, Any]) -> list[str]:
    lines = [
        f"Diagnosis classes of the {t['n_select']} selection items (no edit): {t['classes']}.",
        "",
        "| edit | all: Δ acc / Δ log P | conversion failures: Δ acc / Δ log P |",
        "|---|---|---|",
    ]
    for name, a in t["all"].items():
        c = t["conversion"].get(name, {})
        conv = (
            f"{100 * c['d_correct']:+.1f} / {c['d_logp']:+.3f}"
            if c.get("d_correct") is not None
            else "—"
        )
        lines.append(f"| {name} | {100 * a['d_correct']:+.1f} / {a['d_logp']:+.3f} | {conv} |")
    lines += [""] + confirm_md(t["confirmation"], None, t["n_confirm"])
    return lines


def _options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tr-layers", default="12,13,14,15,16,17", help="translation blocks")
    p.add_argument("--tr-scales", default="0.5,1,2", help="translation scales (x raw difference)")


def _run(ctx: Context, plan: Plan) -> dict[str, Any]:
    a, i = ctx.args, plan.inputs
    return translation(ctx.runner, i["sel"], i["conf"], ctx.facts, ints(a.tr_layers),
                       floats(a.tr_scales), a.top, a.seed, ctx.partial(plan.key))  # fmt: skip


EXPERIMENT = Experiment(
    "translation",
    "Step 3b: translation difference vector, natural units",
    lambda ctx: selection.step3_plan("translation", ctx),
    _run,
    translation_md,
    (selection.options, _options),
)
