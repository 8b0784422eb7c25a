"""A finished run scored again from its kept replies, by today's scorer, without a model.

Every reply of ``eval`` and ``headroom`` is kept in ``replies.jsonl``; when the scorer is fixed
(an audit found a rule wrong), the run's report is rebuilt from those texts instead of running
the model again, and says so (``rescored``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from steerserve.research import evaluate as ev
from steerserve.research import reporting as R
from steerserve.research.replies import Reply, read_replies, rejudge
from steerserve.research.scoring import ArmResult, score_all

Records = Callable[[str], Mapping[str, Mapping[str, Any]]]  # arm -> {item id: record}


def results_of(
    records: Records, replies: Sequence[Reply]
) -> tuple[list[dict], dict[str, ArmResult]]:
    """The first arm's records (in reply order) and each arm's results, re-judged against the
    records that arm asked (``records(arm)``; a headroom condition asks its own chat)."""
    arms: dict[str, list[Reply]] = {}
    for r in replies:
        arms.setdefault(r.arm, []).append(r)
    first = next(iter(arms))
    ids = [r.id for r in arms[first]]
    out: dict[str, ArmResult] = {}
    for arm, rs in arms.items():
        if [r.id for r in rs] != ids:
            raise ValueError(f"arm {arm!r} does not hold the same items in the same order")
        mine = records(arm)
        recs = [dict(mine[i]) for i in ids]
        res = score_all(recs, [r.text for r in rs])
        res.replies = [rejudge(rec, r) for rec, r in zip(recs, rs, strict=True)]
        out[arm] = res
    base = records(first)
    return [dict(base[i]) for i in ids], out


def rescore(out_dir: str | Path, records: Records) -> dict[str, Any]:
    """Rebuild ``out_dir``'s report (and its replies' verdicts) from ``replies.jsonl``;
    ``records(arm)`` maps item ids to the records that arm asked."""
    out = Path(out_dir)
    old = json.loads((out / "report.json").read_text(encoding="utf-8"))
    recs, results = results_of(records, read_replies(out / "replies.jsonl"))
    keep = ("arms", "base_arm", "acceptance", "scoring", "conversion", "native5_vs_english5")
    meta = {k: v for k, v in old.items() if k not in keep}
    meta["rescored"] = "verdicts recomputed from replies.jsonl by the current scorer"
    report = ev.build_report(recs, results, meta, base_arm=old.get("base_arm", "unsteered"))
    ev.write_replies(out / "replies.jsonl", ev.all_replies(results))
    markdown = ev.report_markdown(report)
    if "conversion" in old:
        from steerserve.research.chat_headroom import conversion, conversion_md

        report["conversion"] = conversion(recs, results)
        markdown += "\n".join(conversion_md(report["conversion"])) + "\n"
    R.write(out, report, markdown, {"accuracy.png": lambda p: ev.plot(report, p)})
    return report


def capped(
    out: Path, caps: Sequence[int], model_dir: Path, dataset: Path | None = None
) -> dict[str, dict[int, float]]:
    """Each arm's non-English mean accuracy had its kept replies been cut at each budget in
    ``caps`` (counted with the model's tokenizer; whole replies as well): how much an old,
    shorter budget cost, measured on the same replies."""
    from transformers import AutoTokenizer

    from steerserve.research.scoring import by_lang, lang_mean, non_english

    tok = AutoTokenizer.from_pretrained(model_dir)
    recs = run_records(out, dataset)
    out_rows: dict[str, dict[int, float]] = {}
    replies = read_replies(out / "replies.jsonl")
    for arm in dict.fromkeys(r.arm for r in replies):
        mine = [r for r in replies if r.arm == arm]
        items = [recs(arm)[r.id] for r in mine]
        row = {}
        for cap in [*caps, 0]:
            texts = [
                tok.decode(tok(r.text, add_special_tokens=False)["input_ids"][:cap])
                if cap else r.text
                for r in mine
            ]  # fmt: skip
            ok = score_all(items, texts).correct
            row[cap] = lang_mean(non_english(by_lang(items, ok)))
        out_rows[arm] = row
    return out_rows


def run_records(out: Path, dataset: Path | None = None) -> Records:
    """The records a run asked, per arm (see :func:`run`)."""
    from steerserve.research.audit import chat_records
    from steerserve.research.records import read_dataset

    old = json.loads((out / "report.json").read_text(encoding="utf-8"))
    if dataset is not None:
        recs = {r["id"]: r for r in read_dataset(dataset)}
        return lambda arm: recs
    if "conditions" in old:
        from steerserve.research import chat_headroom as hr

        c = old["config"]
        langs = tuple(c["langs"]) if c["langs"] else None
        cfg = hr.Config(Path(old["model"]), out, c["split"], tuple(c["part"]), langs,
                        c["limit_per_lang"])  # fmt: skip
        by_cond = {k: {r["id"]: r for r in v} for k, v in hr.condition_records(cfg).items()}
        return by_cond.__getitem__
    built_in = chat_records()
    return lambda arm: built_in


def run(out: Path, dataset: Path | None = None) -> dict[str, Any]:
    """:func:`rescore` with the records the run asked: ``dataset``'s, a headroom run's
    conditions rebuilt from its recorded config, else the built-in facts' chat records."""
    return rescore(out, run_records(out, dataset))
