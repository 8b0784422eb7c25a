"""Select on some items, confirm on others: how every vector experiment (step 3) picks its
edits, and how its tables read.

Why: a sweep of dozens of edits on a few dozen items always finds a lucky one; the best by
paired change in mean log P(gold) must show it again on disjoint items, which noise cannot do
twice.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from steerserve.research.cache import cached, slim_steps
from steerserve.research.conditions import langs_of
from steerserve.research.experiments.base import Context, Plan, split_part
from steerserve.research.reporting import pct
from steerserve.research.runner import Edit, Runner
from steerserve.research.scoring import compact, summarise


def select_confirm(
    runner: Runner,
    sel: Sequence[dict],
    conf: Sequence[dict],
    edits: Sequence[Edit],
    top: int,
    partial: Path | None = None,
) -> dict[str, Any]:
    """Run every edit on ``sel``; the ``top`` best by paired Δ mean log P(gold) (non-English)
    are run again on the disjoint ``conf`` items: noise cannot pick them twice. With
    ``partial``, the per-item results of both runs are kept there (resumable)."""
    p = (lambda n: None) if partial is None else (lambda n: partial / n)  # noqa: E731
    res = cached(p("select.json"), lambda: slim_steps(runner.run(sel, [None, *edits])[0]))
    sums = {e.name: summarise(sel, r, res[0]) for e, r in zip(edits, res[1:], strict=True)}
    best = sorted(sums, key=lambda n: -sums[n]["logp"]["diff_non_en"]["diff"])[:top]
    chosen = [e for e in edits if e.name in best]
    cres = cached(
        p(f"confirm-{'+'.join(best)}.json"),
        lambda: slim_steps(runner.run(conf, [None, *chosen])[0]),
    )
    return {
        "selection": {n: compact(v) for n, v in sums.items()},
        "selection_base": compact(summarise(sel, res[0])),
        "chosen": best,
        "confirmation": {
            e.name: summarise(conf, r, cres[0]) for e, r in zip(chosen, cres[1:], strict=True)
        },
        "confirmation_base": summarise(conf, cres[0]),
        "n_select": len(sel),
        "n_confirm": len(conf),
    }


def compact_row(name: str, c: Mapping[str, Any]) -> str:
    return (
        f"| {name} | {100 * c['d_correct']:+.1f} [{100 * c['d_correct_ci95'][0]:+.1f}, "
        f"{100 * c['d_correct_ci95'][1]:+.1f}] | {c['d_logp']:+.3f} [{c['d_logp_ci95'][0]:+.3f}, "
        f"{c['d_logp_ci95'][1]:+.3f}] |"
    )


def confirm_md(conf: Mapping[str, Any], base: Mapping[str, Any] | None, n: int) -> list[str]:
    lines = [f"Confirmation on {n} other items (paired against no edit on them):", ""]
    lines += ["| edit | Δ acc, pts [CI] | Δ log P [CI] | English Δ acc, pts |", "|---|---|---|---|"]
    for name, sm in conf.items():
        c = compact(sm)
        en = sm["correct"].get("diff_en", {}).get("diff")
        lines.append(compact_row(name, c) + (f" {100 * en:+.1f} |" if en is not None else " — |"))
    if base is not None:
        lines += ["", f"No edit there: {pct(base['correct']['non_en'])} % non-English."]
    return lines


def top_md(sel: Mapping[str, Mapping[str, Any]], k: int = 12) -> list[str]:
    lines = ["| edit | Δ acc, pts [CI] | Δ log P [CI] |", "|---|---|---|"]
    for name in sorted(sel, key=lambda n: -sel[n]["d_logp"])[:k]:
        lines.append(compact_row(name, sel[name]))
    return lines


def options(p: argparse.ArgumentParser) -> None:
    """The flags every select-and-confirm experiment shares."""
    p.add_argument("--select-part", type=split_part, default=(0, 8), help="step 3 selection items")
    p.add_argument(
        "--confirm-part", type=split_part, default=(1, 2), help="step 3 confirmation items"
    )
    p.add_argument("--top", type=int, default=3, help="step 3 edits confirmed per search")


def step3_plan(name: str, ctx: Context) -> Plan:
    """The selection and confirmation items of a step-3 experiment, and its setup sentence."""
    a = ctx.args
    sel, conf = ctx.records(a.select_part), ctx.records(a.confirm_part)
    setup = (
        f"Selected by paired Δ mean log P(gold) on {len(sel)} items "
        f"({ctx.describe(a.select_part)}), the best {a.top} confirmed on {len(conf)} others "
        f"({ctx.describe(a.confirm_part)}); languages {', '.join(langs_of(sel))}, English "
        "reported apart."
    )
    return Plan(name, setup, {"sel": sel, "conf": conf})
