"""The learned vector's confirmation, declared in plan.md: paired bootstrap of the learned arm
against the unsteered arm on the confirmation half, by relation group (held-out vs trained).
Reads only kept replies (the two eval runs beside this file); prints and writes confirm.json.

    .venv/bin/python docs/results/qwen2.5-coder-1.5b-instruct/learned/confirm.py L14_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from steerserve.research.replies import read_replies
from steerserve.research.scoring import by_lang, lang_mean, non_english, paired_bootstrap

HERE = Path(__file__).parent


def main(run: Path) -> None:
    recs = {json.loads(x)["id"]: json.loads(x) for x in (HERE / "confirmation.jsonl").open()}
    base = {r.id: r for r in read_replies(HERE / "confirm-unsteered" / "replies.jsonl")}
    steer = {r.id: r for r in read_replies(run / "replies.jsonl") if r.arm == "learned"}
    out = {}
    for group, held in (("held-out relations", True), ("trained relations", False), ("all", None)):
        ids = [
            i for i in recs if i in steer and (held is None or recs[i]["held_out_relation"] == held)
        ]
        items = [recs[i] for i in ids]
        a = by_lang(items, [steer[i].verdict == "correct" for i in ids])
        b = by_lang(items, [base[i].verdict == "correct" for i in ids])
        d = paired_bootstrap(non_english(a), non_english(b))
        en = (lang_mean({"en": a["en"]}) - lang_mean({"en": b["en"]})) if "en" in a else None
        out[group] = {
            "n_non_english": sum(len(v) for k, v in a.items() if k != "en"),
            "unsteered": lang_mean(non_english(b)),
            "learned": lang_mean(non_english(a)),
            "diff": d["diff"],
            "ci95": d["ci95"],
            "english_delta": en,
            "per_language": {k: sum(a[k]) / len(a[k]) - sum(b[k]) / len(b[k]) for k in a},
        }
        print(f"{group}: n={out[group]['n_non_english']} unsteered {100 * out[group]['unsteered']:.1f}"
              f" learned {100 * out[group]['learned']:.1f} diff {100 * d['diff']:+.1f} "
              f"[{100 * d['ci95'][0]:+.1f}, {100 * d['ci95'][1]:+.1f}] English "
              f"{'' if en is None else f'{100 * en:+.1f}'}")  # fmt: skip
    (run / "confirm.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
