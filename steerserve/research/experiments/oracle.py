"""Step 2, oracle ceilings: the last prompt token's state patched at each block.

Why: an edit of the last prompt token's state can at most do what patching in the *right* state
does (the same fact asked in a pivot language, or its relation's mean pivot state); if that
does not lift query-language accuracy, no vector at that token will.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from steerserve.research.cache import cached, cached_tensors, slim, slim_steps
from steerserve.research.conditions import eval_prompt, langs_of
from steerserve.research.experiments.base import Context, Experiment, Plan, ci, ints, split_part
from steerserve.research.extract import last_token_means
from steerserve.research.facts import RELATIONS, Fact, load_facts
from steerserve.research.prefixes import answer_position_note, at_answer_position
from steerserve.research.reporting import pct, pyplot
from steerserve.research.runner import Edit, Runner
from steerserve.research.scoring import summarise


def relation_means(
    model: Any,
    tokenizer: Any,
    langs: Sequence[str],
    per_relation: int,
    seed: int = 0,
    form: str = "completion",
) -> dict[tuple[str, str], torch.Tensor]:
    """``(lang, relation) -> [L, H]``: mean last-token block outputs of the evaluation form
    over the first ``per_relation`` train facts of that relation in that language."""
    out = {}
    for lang in langs:
        for rel in RELATIONS:
            fs = load_facts("train", [lang], [rel])[:per_relation]
            if fs:
                ps = [eval_prompt(f, form, seed) for f in fs]
                out[(lang, rel)] = last_token_means(model, tokenizer, ps, 16, f"{lang}/{rel}")[0]
    return out


#: The pivot languages an oracle patches in, and the query languages each is tried on (None:
#: every other language). English is the paper's pivot; Chinese is where a model's Japanese and
#: Korean answers may pass (the chat model answers them in Chinese).
PIVOTS: dict[str, tuple[str, ...] | None] = {"en": None, "zh": ("ja", "ko")}
VARIANTS: tuple[str, ...] = (
    "replace_fact", "add_fact", "replace_rel", "add_rel", "replace_corrected",
)  # fmt: skip


def answer_position_means(
    runner: Runner, langs: Sequence[str], per_relation: int
) -> dict[tuple[str, str], torch.Tensor]:
    """``(lang, relation) -> [L, H]``: mean block outputs at the name onset (after the model's
    own restated prefix, ``prefixes``) over the first ``per_relation`` train facts."""
    from steerserve.research.facts import eval_records

    out = {}
    for lang in langs:
        for rel in RELATIONS:
            recs = eval_records("train", langs=[lang], relations=[rel], form="chat")
            if recs := recs[:per_relation]:
                _, states = runner.run(at_answer_position(runner, recs), [None], capture=True,
                                       progress=False)  # fmt: skip
                assert states is not None
                out[(lang, rel)] = states.mean(0)
    return out


def oracle_edits(
    layers: Sequence[int],
    h_x: torch.Tensor,
    h_p: torch.Tensor,
    rel_p: torch.Tensor,
    rel_x: torch.Tensor,
    suffix: str = "",
) -> list[Edit]:
    """Step 2's five edits per block (all ``[N, L, H]``, row i = item i; ``p`` the pivot):
    ``replace_fact`` h <- h_p (same fact, pivot-language evaluation form) at the last prompt
    token; ``add_fact`` h <- h + (h_p - h_x) at the last prompt token *and* every later token
    (at the last token the same as replacing; later tokens differ); ``replace_rel`` h <- the
    relation's mean pivot state; ``add_rel`` h <- h + (relation mean pivot - relation mean in
    the query language), last prompt and later tokens: a per-language, per-relation shift;
    ``replace_corrected`` h <- h_p + (relation mean in the query language - relation mean pivot):
    the twin's fact state moved to the query language's side (issue 20's "language-corrected"
    state), so it carries the fact without the pivot's language."""
    edits = []
    for ly in layers:
        edits += [
            Edit.of(f"replace_fact{suffix}@{ly}", ly, "replace", h_p[:, ly]),
            Edit.of(
                f"add_fact{suffix}@{ly}",
                ly,
                "add",
                h_p[:, ly] - h_x[:, ly],
                positions="last_prompt_and_generated",
            ),
            Edit.of(f"replace_rel{suffix}@{ly}", ly, "replace", rel_p[:, ly]),
            Edit.of(
                f"add_rel{suffix}@{ly}",
                ly,
                "add",
                rel_p[:, ly] - rel_x[:, ly],
                positions="last_prompt_and_generated",
            ),
            Edit.of(
                f"replace_corrected{suffix}@{ly}",
                ly,
                "replace",
                h_p[:, ly] + rel_x[:, ly] - rel_p[:, ly],
            ),
        ]
    return edits


def oracle(
    runner: Runner,
    items: Sequence[dict],
    facts: Mapping[str, Fact],
    per_relation: int = 16,
    layers: Sequence[int] | None = None,
    seed: int = 0,
    pivots: Sequence[str] = ("en",),
    partial: Path | None = None,
    group: int = 3,
    answer_position: bool = False,
) -> dict[str, Any]:
    """Step 2: patch the last prompt token's state at each block (see ``oracle_edits``), on the
    items of ``items`` whose pivot twin is there (it supplies h_p); paired against no edit.
    Blocks run ``group`` at a time; with ``partial`` each group is kept there (resumable).
    ``answer_position`` (chat): every item, its twin and the relation means are taken after
    the model's own restated prefix, so the patched state is the one where the name starts."""
    layers = list(range(runner.num_layers)) if layers is None else list(layers)
    form = "chat" if "messages" in items[0] else "completion"
    part = (lambda n: None) if partial is None else (lambda n: partial / n)  # noqa: E731
    t0 = time.perf_counter()
    if answer_position:
        items = cached(part("prefixed.json"), lambda: at_answer_position(runner, items))

    def baseline() -> dict[str, Any]:
        runs, states = runner.run(items, [None], capture=True)
        return {"res": slim(runs[0]), "states": states}

    base_run = cached_tensors(part("baseline.pt"), baseline)
    states = base_run["states"]
    if len(base_run["res"]) != len(items):
        raise ValueError(
            f"{partial}/baseline.pt holds {len(base_run['res'])} items, not "
            f"{len(items)}: it belongs to other items (--langs, --oracle-limit)"
        )
    fid = [facts[r["id"]].fact_id for r in items]
    langs = langs_of(items)
    means = cached_tensors(
        part("relation_means.pt"),
        (lambda: answer_position_means(runner, langs, per_relation))
        if answer_position
        else (lambda: relation_means(runner.model, runner.tok, langs, per_relation, seed, form)),
    )
    t1 = time.perf_counter()
    out: dict[str, Any] = {"layers": layers, "per_relation": per_relation, "pivots": {}}
    out["position"] = "name onset (own prefix)" if answer_position else "last prompt token"
    if answer_position:
        out["prefix_sources"] = answer_position_note(items)
    out["base_all_langs"] = summarise(items, base_run["res"])
    for pv in pivots:
        row = {f: i for i, (f, r) in enumerate(zip(fid, items, strict=True)) if r["lang"] == pv}
        targets = PIVOTS.get(pv)
        sel = [
            i
            for i, r in enumerate(items)
            if r["lang"] not in ("en", pv)
            and (targets is None or r["lang"] in targets)
            and fid[i] in row
        ]
        if not sel:
            continue
        recs = [items[i] for i in sel]
        h_x, h_p = states[sel], states[[row[fid[i]] for i in sel]]
        rels = [facts[r["id"]].relation for r in recs]
        rel_p = torch.stack([means[(pv, rel)] for rel in rels])
        rel_x = torch.stack([means[(r["lang"], rel)] for r, rel in zip(recs, rels, strict=True)])
        sfx = "" if pv == "en" else f".{pv}"
        mid = runner.num_layers // 2
        first: list[Edit | None] = [None, Edit.of(f"self{sfx}@{mid}", mid, "replace", h_x[:, mid])]
        names: list[str] = ["none", f"self{sfx}@{mid}"]
        results: list[list[dict]] = []
        for g in range(0, len(layers), group):
            lys = layers[g : g + group]
            edits = oracle_edits(lys, h_x, h_p, rel_p, rel_x, sfx)
            todo = (first if g == 0 else []) + edits
            res = cached(
                part(f"{pv}-blocks-{'-'.join(map(str, lys))}.json"),
                lambda todo=todo, recs=recs: slim_steps(runner.run(recs, todo)[0]),
            )
            names += [e.name for e in edits]
            results += res
        base = results[0]
        out["pivots"][pv] = {
            "n_items": len(recs),
            "edits": {n: summarise(recs, r, base) for n, r in zip(names, results, strict=True)},
            "items": {
                n: {"correct": [int(x["correct"]) for x in r], "logp": [x["logp"] for x in r]}
                for n, r in zip(names, results, strict=True)
            },
            "ids": [r["id"] for r in recs],
        }
    out["n_items"] = out["pivots"].get("en", {}).get("n_items", 0)
    out["seconds"] = {
        "baseline+means": round(t1 - t0, 1),
        "edits": round(time.perf_counter() - t1, 1),
    }
    return out


def _best_layer(e: Mapping[str, Any], v: str, layers: Sequence[int]) -> int:
    return max(layers, key=lambda x: e[f"{v}@{x}"]["logp"]["diff_non_en"]["diff"])


def oracle_md(o: Mapping[str, Any]) -> list[str]:
    lines: list[str] = []
    if ps := o.get("prefix_sources"):
        counts = ", ".join(f"{k} {v}" for k, v in ps["counts"].items())
        lines += [f"Patched at: {o['position']}; prefixes by source ({counts}).", ""]
    for pv, po in o["pivots"].items():
        e, sfx = po["edits"], "" if pv == "en" else f".{pv}"
        langs = sorted({k for k in e["none"]["correct"]["per_lang"] if k != "en"})
        lines += [
            f"### Pivot {pv}: {po['n_items']} items ({', '.join(langs)})",
            "",
            "Paired against no edit, non-English mean; Δ accuracy in points / Δ mean log P(gold).",
            "",
        ]
        variants = [v + sfx for v in VARIANTS]
        lines += ["| block | " + " | ".join(variants) + " |", "|---" * (len(variants) + 1) + "|"]
        for ly in o["layers"]:
            cells = [
                f"{100 * e[f'{v}@{ly}']['correct']['diff_non_en']['diff']:+.1f} / "
                f"{e[f'{v}@{ly}']['logp']['diff_non_en']['diff']:+.2f}"
                for v in variants
            ]
            lines.append(f"| {ly} | " + " | ".join(cells) + " |")
        lines += ["", "Best block per edit (by Δ log P on these items, so optimistic):", ""]
        lines += ["| edit | block | Δ acc, pts [CI] | Δ log P [CI] | acc % | recall-any % |"]
        lines += ["|---|---|---|---|---|---|"]
        for v in variants:
            ly = _best_layer(e, v, o["layers"])
            sm = e[f"{v}@{ly}"]
            lines.append(
                f"| {v} | {ly} | {ci(sm['correct']['diff_non_en'])} | "
                f"{ci(sm['logp']['diff_non_en'], 1, '{:+.2f}')} | {pct(sm['correct']['non_en'])}"
                f" | {pct(sm['recall_any']['non_en'])} |"
            )
        b = e["none"]
        selfs = [k for k in e if k.startswith("self")]
        lines += [
            "",
            f"No edit: {pct(b['correct']['non_en'])} % non-English accuracy, mean log P "
            f"{b['logp']['non_en']:.2f}, recall-any {pct(b['recall_any']['non_en'])} %. "
            + "".join(
                f"Sanity `{k}` (replace with the item's own state): Δacc "
                f"{100 * e[k]['correct']['diff_non_en']['diff']:+.2f}, Δlog P "
                f"{e[k]['logp']['diff_non_en']['diff']:+.4f}. "
                for k in selfs
            ),
            "",
        ]
    return lines


def oracle_plot(o: Mapping[str, Any], path: Path) -> None:
    """Δ log P(gold) and Δ accuracy per block for each oracle edit and pivot."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ly = sorted(o["layers"])  # a resumed run may list new blocks after the kept ones
    for pv, po in o["pivots"].items():
        sfx = "" if pv == "en" else f".{pv}"
        for v in VARIANTS:
            for ax, key, k in ((axes[0], "logp", 1.0), (axes[1], "correct", 100.0)):
                ds = [po["edits"][f"{v}{sfx}@{x}"][key]["diff_non_en"] for x in ly]
                ax.plot(ly, [k * d["diff"] for d in ds], marker="o", label=f"{v}{sfx}",
                        ls="-" if pv == "en" else "--")  # fmt: skip
                ax.fill_between(ly, [k * d["ci95"][0] for d in ds],
                                [k * d["ci95"][1] for d in ds], alpha=0.12)  # fmt: skip
    axes[0].set(xlabel="block", ylabel="Δ mean log P(gold), non-English", title="log P")
    axes[1].set(xlabel="block", ylabel="Δ accuracy (points)", title="greedy accuracy")
    for ax in axes:
        ax.axhline(0, color="grey", lw=0.8)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--oracle-part", type=split_part, default=(0, 4), help="oracle items, as --part")
    p.add_argument("--oracle-limit", type=int, default=None, help="oracle items per language")
    p.add_argument("--per-relation", type=int, default=16, help="train facts per relation mean")
    p.add_argument("--layers", default=None, help="oracle blocks, e.g. 0,4,8 (default: all)")
    p.add_argument(
        "--pivots", default="en", help="oracle pivot languages: en, zh (zh is tried on ja, ko)"
    )
    p.add_argument(
        "--answer-position",
        action="store_true",
        help="chat: patch where the name starts, after the model's own restated prefix",
    )


def _plan(ctx: Context) -> Plan:
    a = ctx.args
    items = ctx.records(a.oracle_part, a.oracle_limit)
    pivots = a.pivots.split(",")
    setup = (
        f"{len(items)} items ({ctx.describe(a.oracle_part)}; languages "
        f"{', '.join(langs_of(items))}); pivots {', '.join(pivots)} (zh tried on "
        f"{', '.join(PIVOTS['zh'] or ())}); relation means over {a.per_relation} train "
        "facts per relation and language."
    )
    key = f"oracle@{a.oracle_part[0]}of{a.oracle_part[1]}"
    if a.answer_position:
        key += "@answer"
        setup += " Patched at the name onset, after each item's own restated prefix."
    return Plan(key, setup, {"items": items, "pivots": pivots})


def _run(ctx: Context, plan: Plan) -> dict[str, Any]:
    a = ctx.args
    layers = None if a.layers is None else ints(a.layers)
    items, pivots = plan.inputs["items"], plan.inputs["pivots"]
    return oracle(ctx.runner, items, ctx.facts, a.per_relation, layers, a.seed, pivots,
                  ctx.partial(plan.key), answer_position=a.answer_position)  # fmt: skip


def _figures(o: Mapping[str, Any]) -> dict[str, Callable[[Path], None]]:
    """The per-block plot, where more than one block ran."""
    return {"": lambda p: oracle_plot(o, p)} if len(o["layers"]) > 1 else {}


EXPERIMENT = Experiment(
    "oracle",
    "Step 2: oracle ceilings (last-prompt-token patching)",
    _plan,
    _run,
    oracle_md,
    (_options,),
    _figures,
)
