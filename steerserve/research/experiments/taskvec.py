"""Step 3a, the recall task vector (Hendel et al.): the mean block state of 5-shot prompts,
applied to the zero-shot and evaluation forms by interpolation and by addition.

Why: if demonstrations help (step 1), their effect on the last token's state may be a vector
that can be added without them.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from steerserve.research.cache import cached_tensors
from steerserve.research.conditions import as_prompt, form_prompt, pooled_means, pooled_train_facts
from steerserve.research.experiments import selection
from steerserve.research.experiments.base import Context, Experiment, Plan, floats, ints
from steerserve.research.experiments.selection import confirm_md, select_confirm, top_md
from steerserve.research.facts import Fact, load_facts
from steerserve.research.reporting import pct
from steerserve.research.runner import Edit, Runner


def task_vectors(
    runner: Runner,
    sel: Sequence[dict],
    conf: Sequence[dict],
    facts: Mapping[str, Fact],
    layers: Sequence[int],
    top: int = 3,
    seed: int = 0,
    targets: Sequence[str] = ("zero", "eval"),
    sources: Sequence[str] = ("en", "native", "mixed"),
    alphas: Sequence[float] = (0.25, 0.5, 1.0),
    partial: Path | None = None,
) -> dict[str, Any]:
    """Step 3a: Hendel et al.'s task vector v = raw mean block-L last-token state of 5-shot
    prompts over the ~200 train facts (``sources``: demonstrations and question in English,
    in the query language, or English demonstrations before a query-language question;
    languages pooled), applied at the last prompt token of the ``targets`` forms (zero-shot,
    the evaluation form; a chat's are one) by interpolation h <- (1 - a) h + a v and by
    addition h <- h + (v - mean state of the target form)."""
    form = "chat" if "messages" in sel[0] else "completion"
    targets = ["eval"] if form == "chat" else list(targets)
    langs = sorted({r["lang"] for r in sel} - {"en"})
    pool = pooled_train_facts(langs)
    en = load_facts("train", ["en"])
    groups: dict[str, list[Any]] = {
        "en": [form_prompt(f, "native5", form, seed) for f in en],
        "native": [form_prompt(f, "native5", form, seed) for f in pool],
        "mixed": [form_prompt(f, "mixed5", form, seed) for f in pool],
    }
    groups = {k: v for k, v in groups.items() if k in sources}
    groups |= {t: [form_prompt(f, t, form, seed) for f in pool] for t in targets}
    t0 = time.perf_counter()
    means = cached_tensors(
        None if partial is None else partial / "means.pt",
        lambda: pooled_means(runner.model, runner.tok, groups),
    )
    out: dict[str, Any] = {"means_seconds": round(time.perf_counter() - t0, 1), "forms": {}}
    out["norms"] = {k: [round(float(v.norm()), 1) for v in m] for k, m in means.items()}
    for target in targets:
        edits = []
        for src in sources:
            for ly in layers:
                v = means[src][ly]
                edits += [Edit.of(f"{src}.interp{a}@{ly}", ly, "interp", v, a) for a in alphas]
                edits.append(Edit.of(f"{src}.add@{ly}", ly, "add", v - means[target][ly]))
        kind = "zero" if target == "zero" else "eval"
        recs_s = [{**r, **as_prompt(form_prompt(facts[r["id"]], kind, form, seed))} for r in sel]
        recs_c = [{**r, **as_prompt(form_prompt(facts[r["id"]], kind, form, seed))} for r in conf]
        sub = None if partial is None else partial / target
        out["forms"][target] = select_confirm(runner, recs_s, recs_c, edits, top, sub)
    return out


def taskvec_md(t: Mapping[str, Any]) -> list[str]:
    lines: list[str] = []
    for form, f in t["forms"].items():
        b = f["selection_base"]
        lines += [
            "### Applied to the "
            + (
                "zero-shot form"
                if form == "zero"
                else "evaluation form (completion: 3-shot; chat: the zero-shot chat turn)"
            ),
            "",
            f"Selection: {f['n_select']} items, no edit {pct(b['correct'])} % non-English, "
            f"mean log P {b['logp']:.2f}. Best {min(12, len(f['selection']))} of "
            f"{len(f['selection'])} edits by Δ log P:",
            "",
        ]
        lines += top_md(f["selection"]) + [""]
        lines += confirm_md(f["confirmation"], f["confirmation_base"], f["n_confirm"]) + [""]
    return lines


def _options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tv-layers", default="2,4,6,8,10", help="task-vector blocks")
    p.add_argument(
        "--tv-targets", default="zero,eval", help="forms task vectors are applied to (completion)"
    )
    p.add_argument("--tv-sources", default="en,native,mixed", help="task-vector demonstrations")
    p.add_argument("--tv-alphas", default="0.25,0.5,1", help="task-vector interpolation weights")


def _run(ctx: Context, plan: Plan) -> dict[str, Any]:
    a, i = ctx.args, plan.inputs
    return task_vectors(
        ctx.runner, i["sel"], i["conf"], ctx.facts, ints(a.tv_layers), a.top, a.seed,
        a.tv_targets.split(","), a.tv_sources.split(","), floats(a.tv_alphas),
        ctx.partial(plan.key),
    )  # fmt: skip


EXPERIMENT = Experiment(
    "taskvec",
    "Step 3a: recall task vector (Hendel et al.), interpolation and addition",
    lambda ctx: selection.step3_plan("taskvec", ctx),
    _run,
    taskvec_md,
    (selection.options, _options),
)
