"""The test stage: the untouched test records once through the engine (``unsteered``, ``auto``,
``both``); only reported, since a gate moved by them would make them one more selection.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from steerserve.tune.arms import COMBINED, UNSTEERED
from steerserve.tune.scoring import by_lang, lang_mean, non_english, paired_bootstrap

AUTO = "auto"


def auto_entries(art: Any, records: Sequence[dict]) -> list[Any]:
    """Per record, the entries ``auto`` applies: the artifact's at its language's multiplier,
    or none (English, a closed or unlisted language)."""
    names = [iv.name for iv in art.manifest.interventions]
    out = []
    for r in records:
        m = art.manifest.auto_multiplier(r["lang"])
        out.append(art.entries(dict.fromkeys(names, m)) if m > 0 else None)
    return out


def run_test(ctx: Any) -> None:
    """Generate, score and compare; writes ``test.json`` and ``replies.jsonl``."""
    from tqdm import tqdm

    from steerserve.artifacts import load_artifact
    from steerserve.tune import evaluate as ev
    from steerserve.tune.replies import budget, judge, write_replies
    from steerserve.tune.reporting import write_json

    records = ctx.parts.test
    art = load_artifact(ctx.artifact_dir, model_dir=ctx.model_dir)
    auto = auto_entries(art, records)
    arms: dict[str, list[Any]] = {
        UNSTEERED: [None] * len(records),
        COMBINED: [art.entries()] * len(records),
    }
    same = all(e is None for e in auto)
    if not same:
        arms[AUTO] = auto
    max_tokens = budget(ctx.parts.form)
    t0 = time.perf_counter()
    eng = ev.open_engine(
        ctx.model_dir, ctx.cfg.engine_dtype, ctx.cfg.max_num_seqs, ctx.kv_cache_bytes
    )
    t_engine = time.perf_counter() - t0
    correct: dict[str, list[bool]] = {}
    replies = []
    try:
        ev.register_artifact(eng, art)
        prompts = ev.record_prompts(eng, records)
        with tqdm(total=len(records) * len(arms), desc="test", unit="reply") as bar:
            for arm, steering in arms.items():
                gens = ev.generate(eng, prompts, steering, max_tokens, progress=bar.update,
                                   form=ctx.parts.form)  # fmt: skip
                judged = [judge(r, arm, g) for r, g in zip(records, gens, strict=True)]
                correct[arm] = [x.verdict == "correct" for x in judged]
                replies += judged
    finally:
        eng.shutdown()
    if same:
        correct[AUTO] = correct[UNSTEERED]  # no gate open: auto serves exactly the unsteered tokens
    write_replies(ctx.work / "replies.jsonl", replies)
    write_json(
        ctx.work / "test.json",
        {
            "n_items": len(records),
            "max_tokens": max_tokens,
            "auto_is_unsteered": same,
            "seconds": {
                "engine_start": round(t_engine, 1),
                "total": round(time.perf_counter() - t0, 1),
            },
            **compare(records, correct),
        },
    )


def compare(records: Sequence[dict], correct: dict[str, list[bool]]) -> dict[str, Any]:
    """Per arm, per-language accuracy and the paired change against the unsteered arm (95 %
    CIs), and the non-English mean's."""
    base = by_lang(records, correct[UNSTEERED])
    arms: dict[str, Any] = {}
    for arm, c in correct.items():
        acc = by_lang(records, c)
        row: dict[str, Any] = {
            "non_english_mean": round(lang_mean(non_english(acc)), 4),
            "per_language": {
                k: {"n": len(v), "accuracy": round(sum(v) / len(v), 4)} for k, v in acc.items()
            },
        }
        if arm != UNSTEERED:
            d = paired_bootstrap(non_english(acc), non_english(base))
            row["vs_unsteered"] = {
                "diff": round(d["diff"], 4),
                "ci95": [round(x, 4) for x in d["ci95"]],
            }
            for k in acc:
                dk = paired_bootstrap({k: acc[k]}, {k: base[k]})
                row["per_language"][k]["vs_unsteered"] = {
                    "diff": round(dk["diff"], 4), "ci95": [round(x, 4) for x in dk["ci95"]],
                }  # fmt: skip
        arms[arm] = row
    return {"arms": arms}
