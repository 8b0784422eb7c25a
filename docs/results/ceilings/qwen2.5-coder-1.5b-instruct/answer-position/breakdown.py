"""Per-language, per-prefix-source breakdown of the answer-position oracle (issue 20), and its
kept replies.

    .venv/bin/python docs/results/ceilings/qwen2.5-coder-1.5b-instruct/answer-position/breakdown.py

First run after the oracle: writes replies.jsonl (every item's greedy continuation under every
edit, from partial/) so the numbers below can be re-read without the run's partial files; then
prints, per edit at its best block by Δ accuracy, paired Δ accuracy per language, for items whose
prefix is the model's own words (own, echo) or not, and the share of replies naming the English
answer, with paired bootstrap CIs.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent
KEY = "oracle@0of4@answer"
VARIANTS = ("replace_fact", "add_fact", "replace_rel", "add_rel", "replace_corrected")


def write_replies(path: Path) -> None:
    """One line per (edit, non-English item): id, language, prefix, its source, reply, scores."""
    part = HERE / "partial" / KEY
    items = [r for r in json.loads((part / "prefixed.json").read_text()) if r["lang"] != "en"]
    rows = []
    for f in sorted(part.glob("en-blocks-*.json"), key=lambda p: int(p.stem.split("-")[2])):
        blocks = [int(x) for x in f.stem.split("-")[2:]]
        names = (["none", "self@14"] if blocks[0] == 10 else [])
        names += [f"{v}@{b}" for b in blocks for v in VARIANTS]
        for name, res in zip(names, json.loads(f.read_text()), strict=True):
            for it, x in zip(items, res, strict=True):
                rows.append({"edit": name, "id": it["id"], "lang": it["lang"],
                             "prefix": it["reply_prefix"], "source": it["prefix_source"],
                             "reply": x["text"], "correct": bool(x["correct"]),
                             "english": bool(x["english"]), "logp": x["logp"]})  # fmt: skip
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def ci(diffs: list[float], n: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """Mean and paired bootstrap 95 % interval of per-item differences."""
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(diffs, k=len(diffs))) / len(diffs) for _ in range(n))
    return sum(diffs) / len(diffs), means[int(0.025 * n)], means[int(0.975 * n)]


def main() -> None:
    path = HERE / "replies.jsonl"
    if not path.exists():
        write_replies(path)
    by: dict[str, list[dict]] = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        by.setdefault(r["edit"], []).append(r)
    base = by["none"]
    groups = {f"{g}": [k for k, r in enumerate(base) if r["lang"] == g]
              for g in sorted({r["lang"] for r in base})}  # fmt: skip
    groups["own words (own, echo)"] = [k for k, r in enumerate(base) if r["source"] in ("own", "echo")]
    groups["borrowed or none"] = [k for k, r in enumerate(base) if r["source"] not in ("own", "echo")]
    groups["wrong unpatched"] = [k for k, r in enumerate(base) if not r["correct"]]
    eng = sum(r["english"] for r in base)
    print(f"no edit: {sum(r['correct'] for r in base)}/{len(base)} correct, {eng} name the English answer\n")
    print("Δ accuracy in points vs no edit, each edit at its best block by Δ accuracy (optimistic):")
    for v in VARIANTS:
        best = max((n for n in by if n.split("@")[0] == v),
                   key=lambda n: (sum(r["correct"] for r in by[n]), -int(n.split("@")[1])))  # fmt: skip
        row = by[best]
        print(f"\n{best}: English answers {sum(r['english'] for r in row)} (no edit {eng})")
        for g, ks in groups.items():
            m, lo, hi = ci([100.0 * (row[k]["correct"] - base[k]["correct"]) for k in ks])
            print(f"    {g:24s} n={len(ks):3d}  {m:+6.1f} [{lo:+.1f}, {hi:+.1f}]")
    print("\nEnglish answers by block (of 60):")
    for v in VARIANTS:
        cells = [f"{n.split('@')[1]}:{sum(r['english'] for r in by[n])}" for n in by if n.split("@")[0] == v]
        print(f"    {v:18s} " + " ".join(cells))


if __name__ == "__main__":
    main()
