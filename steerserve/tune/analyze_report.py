"""The diagnosis report: per arm and language, the lens and the failure split, what each steered
arm changes against unsteered, computed findings, tables and figures.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from steerserve.tune import reporting as R
from steerserve.tune.analyze import CLASSES, Item, LensConfig
from steerserve.tune.analyze_plots import figures
from steerserve.tune.arms import UNSTEERED, base_arm

#: The recall / conversion split of wrong non-English answers reported for larger models (Lu et
#: al., 2025), shown next to ours.
REFERENCE_SPLIT: dict[str, float] = {"recall": 0.78, "conversion": 0.22}
VS = f"vs_{UNSTEERED}"


# --- summaries --------------------------------------------------------------------------------


def _nanmedian(rows: list[np.ndarray]) -> list[float | None]:
    if not rows:
        return []
    a = np.stack(rows)
    with np.errstate(all="ignore"):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            m = np.nanmedian(a, 0)
    return [None if math.isnan(x) else float(x) for x in m]


def _above(items: Sequence[Item]) -> list[float | None]:
    """Per lens point, the share of items whose English answer outranks the target answer (the
    English pivot); items whose two answers share a first token say nothing and are left out."""
    rows = [(it.en_rank, it.tgt_rank) for it in items]
    rows = [(e, t) for e, t in rows if not (np.isnan(e).all() or np.isnan(t).all())]
    if not rows:
        return []
    return np.mean([e < t for e, t in rows], 0).tolist()


def _zh_above(items: Sequence[Item], other: str) -> list[float | None]:
    """Per lens point, the share of items whose Chinese answer outranks the ``other`` answer
    (``en`` or ``target``), over items whose two first tokens differ."""
    rows = []
    for it in items:
        o = it.en_rank if other == "en" else it.tgt_rank
        z = it.zh_rank
        if z is None or np.isnan(z).all() or np.isnan(o).all() or np.array_equal(z, o):
            continue
        rows.append(z < o)
    return np.mean(rows, 0).tolist() if rows else []


def first_layer(ranks: np.ndarray, threshold: int) -> int | None:
    """First block whose output ranks the token <= threshold (-1: the embeddings)."""
    hit = np.nonzero(ranks <= threshold)[0]
    return int(hit[0]) - 1 if hit.size else None


def summarise(items: Sequence[Item], threshold: int) -> dict[str, Any]:
    """Accuracy, lens medians by layer, first-formation layers and failure split of a group."""
    n = len(items)
    counts = {c: sum(it.cls == c for it in items) for c in CLASSES}
    wrong = counts["recall"] + counts["conversion"]
    en_first = [first_layer(it.en_rank, threshold) for it in items]
    en_first_ok = [x for x in en_first if x is not None]

    def share(k: int) -> float | None:
        return k / wrong if wrong else None

    return {
        "n": n,
        "accuracy": sum(it.correct for it in items) / n if n else 0.0,
        "english_rate": sum(it.english for it in items) / n if n else 0.0,
        "recall_any": sum(it.recall_any for it in items) / n if n else 0.0,
        "shared_first_token": sum(it.shared_first_token for it in items) / n if n else 0.0,
        "median_rank_en": _nanmedian([it.en_rank for it in items]),
        "median_rank_target": _nanmedian([it.tgt_rank for it in items]),
        "mean_prob_en": np.mean([it.en_prob for it in items], 0).tolist() if n else [],
        "mean_prob_target": np.mean([it.tgt_prob for it in items], 0).tolist() if n else [],
        "en_above_target_share": _above([it for it in items if not it.shared_first_token]),
        "chinese_rate": sum(it.chinese for it in items) / n if n else 0.0,
        "median_rank_zh": _nanmedian([it.zh_rank for it in items if it.zh_rank is not None]),
        "zh_above_en_share": _zh_above(items, "en"),
        "zh_above_target_share": _zh_above(items, "target"),
        "en_formed_share": len(en_first_ok) / n if n else 0.0,
        "en_first_layer_median": float(np.median(en_first_ok)) if en_first_ok else None,
        "failures": {
            **counts,
            "wrong": wrong,
            "recall_share": share(counts["recall"]),
            "conversion_share": share(counts["conversion"]),
            "answered_in_english": sum(it.english for it in items if it.cls == "conversion"),
        },
    }


def transitions(base: Sequence[Item], arm: Sequence[Item]) -> dict[str, int]:
    """How a steered arm changes each non-English item relative to the unsteered run."""
    out = {"fixed": 0, "broken": 0, "recall_fixed": 0, "conversion_fixed": 0}
    out |= {"recall_to_conversion": 0, "to_english": 0, "from_english": 0}
    for b, a in zip(base, arm, strict=True):
        if b.lang == "en":
            continue
        out["fixed"] += a.correct and not b.correct
        out["broken"] += b.correct and not a.correct
        out["recall_fixed"] += b.cls == "recall" and a.correct
        out["conversion_fixed"] += b.cls == "conversion" and a.correct
        out["recall_to_conversion"] += b.cls == "recall" and a.cls == "conversion"
        out["to_english"] += a.english and not b.english
        out["from_english"] += b.english and not a.english
    return {k: int(v) for k, v in out.items()}


def build_report(
    results: Mapping[str, Sequence[Item]], cfg: LensConfig, num_layers: int, meta: Mapping
) -> dict[str, Any]:
    """``report.json``: per arm, per language and pooled non-English summaries."""
    lo, hi = cfg.blocks(num_layers)
    arms: dict[str, Any] = {}
    for arm, items in results.items():
        langs = list(dict.fromkeys(it.lang for it in items))
        a: dict[str, Any] = {
            "per_language": {
                g: summarise([it for it in items if it.lang == g], cfg.threshold) for g in langs
            },
            "non_english": summarise([it for it in items if it.lang != "en"], cfg.threshold),
        }
        if arm != UNSTEERED and UNSTEERED in results:
            a[VS] = transitions(results[UNSTEERED], items)
        a["items"] = [
            {
                "id": it.id,
                "answer": it.answer,
                "class": it.cls,
                "english": it.english,
                "lang": it.lang,
                "shared_first_token": it.shared_first_token,
                "en_rank": [None if math.isnan(x) else int(x) for x in it.en_rank],
                "target_rank": [None if math.isnan(x) else int(x) for x in it.tgt_rank],
                "chinese": it.chinese,
                "zh_rank": None
                if it.zh_rank is None
                else [None if math.isnan(x) else int(x) for x in it.zh_rank],
            }
            for it in items
        ]
        arms[arm] = a
    base = results.get(UNSTEERED) or next(iter(results.values()), [])
    return {
        **meta,
        "pivot": pivot(base, num_layers),
        "num_layers": num_layers,
        "lens_points": ["emb"] + [str(i) for i in range(num_layers)],
        "threshold": cfg.threshold,
        "window": [lo, hi],
        "max_tokens": cfg.max_tokens,
        "reference_split": REFERENCE_SPLIT,
        "arms": arms,
    }


def pivot_window(num_layers: int) -> tuple[int, int]:
    """The blocks read for the pivot: the middle of the stack, from a third of the depth up to
    the block before the last (where the output language takes over)."""
    return num_layers // 3, num_layers - 2


def pivot(items: Sequence[Item], num_layers: int) -> dict[str, Any]:
    """Per query language, ``zh`` when the Chinese answer outranks the English one in more than
    half the items of the middle blocks (:func:`pivot_window`), else ``en``."""
    lo, hi = pivot_window(num_layers)
    out: dict[str, Any] = {"window": [lo, hi], "per_language": {}}
    for g in dict.fromkeys(it.lang for it in items):
        grp = [it for it in items if it.lang == g]
        share = _zh_above(grp, "en")
        if not share:
            continue
        w = slice(lo + 1, hi + 2)  # lens index = block + 1
        zh = [it.zh_rank[w] for it in grp if it.zh_rank is not None]
        med = {
            k: float(np.nanmedian(np.stack(v))) if v and not np.isnan(np.stack(v)).all() else None
            for k, v in (
                ("median_rank_en", [it.en_rank[w] for it in grp]),
                ("median_rank_zh", zh),
                ("median_rank_target", [it.tgt_rank[w] for it in grp]),
            )
        }
        m = float(np.mean(share[w]))
        n = sum(it.zh_rank is not None and not np.array_equal(it.zh_rank, it.en_rank) for it in grp)
        out["per_language"][g] = {
            "n": n,
            "zh_above_en_share": m,
            **med,
            "pivot": "zh" if m > 0.5 else "en" if m < 0.5 else "tie",
        }
    return out


# --- report -----------------------------------------------------------------------------------


def _rk(x: float | None) -> str:
    return "–" if x is None else f"{x:.0f}" if x >= 10 else f"{x:.1f}"


def _first_below(ranks: Sequence[float | None], threshold: float) -> int | None:
    """First block whose median rank is <= threshold (-1: embeddings)."""
    for i, r in enumerate(ranks):
        if r is not None and r <= threshold:
            return i - 1
    return None


SENSITIVITY: tuple[int, ...] = (1, 3, 10, 30, 100)


def sensitivity(rep: Mapping[str, Any], arm: str) -> list[dict[str, Any]]:
    """Conversion share of wrong non-English answers at other thresholds, from the per-item
    ranks in the report; also over items whose English and target first tokens differ."""
    lo, hi = rep["window"]
    wrong = []
    for it in rep["arms"][arm]["items"]:
        lang = it.get("lang", it["id"].rsplit(":", 1)[-1])
        if lang == "en" or it["class"] in ("correct", "unknown"):
            continue
        w = [r for r in it["en_rank"][lo + 1 : hi + 2] if r is not None]
        shared = it.get("shared_first_token", it["en_rank"] == it["target_rank"])
        wrong.append((min(w) if w else math.inf, shared))
    rows = []
    for th in SENSITIVITY:
        conv = [r <= th for r, _ in wrong]
        dist = [r <= th for r, sh in wrong if not sh]
        rows.append(
            {
                "threshold": th,
                "n_wrong": len(conv),
                "conversion_share": sum(conv) / len(conv) if conv else None,
                "n_distinct": len(dist),
                "conversion_share_distinct": sum(dist) / len(dist) if dist else None,
            }
        )
    return rows


def findings(rep: Mapping[str, Any]) -> list[str]:
    """The report's headline numbers as sentences, computed (not written by hand)."""
    arms, th = rep["arms"], rep["threshold"]
    base = base_arm(arms)
    ne = arms[base]["non_english"]
    f = ne["failures"]
    out = []
    e1, t1 = _first_below(ne["median_rank_en"], th), _first_below(ne["median_rank_target"], th)
    e_top, t_top = _first_below(ne["median_rank_en"], 1), _first_below(ne["median_rank_target"], 1)
    ab = ne["en_above_target_share"]
    last = len(ne["median_rank_en"]) - 1
    formed = [i for i, r in enumerate(ne["median_rank_en"][:last]) if r is not None and r <= 100]
    span = [ab[i] for i in formed if ab and ab[i] is not None]

    def blk(b: int | None) -> str:
        return "never" if b is None else f"at block {b}"

    out.append(
        f"- Arm `{base}`, {ne['n']} non-English items: the median English answer reaches rank "
        f"<= {th} {blk(e1)} (top-1: {blk(e_top)}); the median target answer {blk(t1)} (top-1: "
        f"{blk(t_top)})."
    )
    if span:
        out.append(
            f"- Where the median English answer is within rank 100 before the last block (blocks "
            f"{formed[0] - 1}..{formed[-1] - 1}), it outranks the target answer in {R.pct(min(span))}–"
            f"{R.pct(max(span))} % of items (first tokens differing); at the last block in "
            f"{R.pct(ab[-1])} %. (Before the answer forms, English tokens outrank others by "
            "frequency alone, so early-layer shares say little.)"
        )
    if f["wrong"]:
        out.append(
            f"- {f['wrong']} wrong non-English answers: {R.pct(f['recall_share'])} % recall "
            f"failures, {R.pct(f['conversion_share'])} % conversion failures (reference: "
            f"{R.pct(REFERENCE_SPLIT['recall'])} % / {R.pct(REFERENCE_SPLIT['conversion'])} %); "
            f"{f['answered_in_english']} of the conversion failures were answered in English; "
            f"{f['unknown']} unclassifiable."
        )
    pv = rep.get("pivot") or {}
    if pv.get("per_language"):
        lo, hi = pv["window"]
        parts = [
            f"{g} {p['pivot']} ({R.pct(p['zh_above_en_share'])} %)"
            for g, p in pv["per_language"].items()
            if g not in ("en", "zh")
        ]
        out.append(
            f"- Pivot in blocks {lo}..{hi} (share of items whose Chinese answer outranks the "
            f"English one): {', '.join(parts)}; answered in Chinese: "
            f"{R.pct(ne['chinese_rate'])} % of non-English items."
        )
    for a, r in arms.items():
        if a == base:
            continue
        s, t = r["non_english"], r.get(VS, {})
        out.append(
            f"- `{a}`: accuracy {R.pct(ne['accuracy'])} → {R.pct(s['accuracy'])} %, answered in "
            f"English {R.pct(ne['english_rate'])} → {R.pct(s['english_rate'])} %, recall-any "
            f"{R.pct(ne['recall_any'])} → {R.pct(s['recall_any'])} %; recall failures "
            f"{f['recall']} → {s['failures']['recall']}, conversion failures {f['conversion']} → "
            f"{s['failures']['conversion']}; English answer first at rank <= {th} (median block) "
            f"{ne['en_first_layer_median']} → {s['en_first_layer_median']}"
            + (f"; fixed {t['fixed']}, broken {t['broken']}." if t else ".")
        )
    return out


def report_markdown(rep: Mapping[str, Any]) -> str:
    """Tables: rank by layer (pooled and per language), failure split, what steering moves."""
    arms = rep["arms"]
    L = [f"# Diagnosis: logit lens and recall vs conversion failures ({rep.get('model', '')})", ""]
    for k in ("dataset", "n_items", "sample_per_lang", "artifact", "interventions", "timings_s"):
        if k in rep:
            L.append(f"- **{k}**: `{json.dumps(rep[k], ensure_ascii=False)}`")
    L += _how_to_read(rep) + ["", "## Findings (computed)", "", *findings(rep)]
    L += _lens_table(rep) + _per_language(rep) + _pivot(rep) + _failures(rep) + _steering(rep)
    L += ["", "## Figures", ""]
    L += [f"![lens {a}](lens_{a}.png)" for a in arms]
    L += ["![lens by arm](lens_arms.png)", "![failures](failures.png)", ""]
    return "\n".join(L)


def _heading(title: str) -> list[str]:
    return ["", f"## {title}", ""]


def _how_to_read(rep: Mapping[str, Any]) -> list[str]:
    lo, hi = rep["window"]
    return [
        "",
        "**How to read.** Logit lens at the last prompt token: the residual stream after the "
        "embeddings (`emb`) and after each block `L` (= `hidden_states[L+1]`) is projected through "
        "the final norm and unembedding. *Rank* is the 1-based rank of the first token the model "
        "would emit for the answer (separator included; best-ranked alias) among "
        f"{rep.get('vocab_size', 'all')} tokens. A wrong non-English greedy answer (first line of "
        f"up to {rep['max_tokens']} tokens) is a **conversion failure** if the English answer "
        f"reached rank <= {rep['threshold']} in blocks {lo}..{hi}, else a **recall failure** "
        "(*unknown*: no informative English first token). Arms add the artifact's interventions "
        "with transformers hooks at their layer, scale and positions.",
    ]


def _lens_table(rep: Mapping[str, Any]) -> list[str]:
    arms = rep["arms"]
    L = [
        *_heading(
            "Median rank by layer, non-English items pooled (English answer / target answer)"
        ),
        "*en > target*: share of items (first tokens differ) whose English answer outranks the "
        "target answer at that point.",
        "",
        "| block | " + " | ".join(f"{a}: en | {a}: target | {a}: en > target" for a in arms) + " |",
        "|---|" + "---|---|---|" * len(arms),
    ]
    for i, p in enumerate(rep["lens_points"]):
        cells = []
        for a in arms:
            ne = arms[a]["non_english"]
            ab = ne["en_above_target_share"]
            cells += [_rk(ne["median_rank_en"][i]), _rk(ne["median_rank_target"][i])]
            cells.append(f"{R.pct(ab[i])} %" if ab else "–")
        L.append(f"| {p} | " + " | ".join(cells) + " |")
    return L


def _per_language(rep: Mapping[str, Any]) -> list[str]:
    lo, hi = rep["window"]
    base = base_arm(rep["arms"])
    shown = sorted({0, lo, (lo + hi) // 2, hi - 2, hi - 1, hi} & set(range(rep["num_layers"])))
    L = [
        *_heading(f"Per language, arm `{base}`: median rank English / target at selected blocks"),
        "| lang | n | "
        + " | ".join(f"block {b}" for b in shown)
        + f" | first block en rank <= {rep['threshold']} (median) | en formed | same first token |",
        "|---|---|" + "---|" * len(shown) + "---|---|---|",
    ]
    for g, s in rep["arms"][base]["per_language"].items():
        cells = [
            f"{_rk(s['median_rank_en'][b + 1])} / {_rk(s['median_rank_target'][b + 1])}"
            for b in shown
        ]
        fl = s["en_first_layer_median"]
        L.append(
            f"| {g} | {s['n']} | " + " | ".join(cells) + f" | {'–' if fl is None else fl} | "
            f"{R.pct(s['en_formed_share'])} % | {R.pct(s['shared_first_token'])} % |"
        )
    return L


def _pivot(rep: Mapping[str, Any]) -> list[str]:
    pv = rep.get("pivot") or {}
    if not pv.get("per_language"):
        return []
    lo, hi = pv["window"]
    base = base_arm(rep["arms"])
    L = [
        *_heading(f"Pivot language, arm `{base}`: English or Chinese in blocks {lo}..{hi}?"),
        "*zh > en*: mean over the blocks of the share of items whose Chinese answer's first token "
        "outranks the English answer's (items whose two first tokens differ); median ranks over "
        "items and blocks. For zh queries the Chinese answer is the target.",
        "",
        "| lang | n | zh > en | median rank en | median rank zh | median rank target | pivot |",
        "|---|---|---|---|---|---|---|",
    ]
    for g, p in pv["per_language"].items():
        L.append(
            f"| {g} | {p['n']} | {R.pct(p['zh_above_en_share'])} % | {_rk(p['median_rank_en'])} "
            f"| {_rk(p['median_rank_zh'])} | {_rk(p['median_rank_target'])} | {p['pivot']} |"
        )
    per = rep["arms"][base]["per_language"]
    shown = sorted({lo, (lo + hi) // 2, hi, rep["num_layers"] - 1})
    L += [
        "",
        "Median rank English / Chinese / target answer at selected blocks:",
        "",
        "| lang | " + " | ".join(f"block {b}" for b in shown) + " |",
        "|---|" + "---|" * len(shown),
    ]
    for g, s in per.items():
        if not s.get("median_rank_zh"):
            continue
        cells = [
            f"{_rk(s['median_rank_en'][b + 1])} / {_rk(s['median_rank_zh'][b + 1])} / "
            f"{_rk(s['median_rank_target'][b + 1])}"
            for b in shown
        ]
        L.append(f"| {g} | " + " | ".join(cells) + " |")
    return L


def _failures(rep: Mapping[str, Any]) -> list[str]:
    lo, hi = rep["window"]
    base = base_arm(rep["arms"])
    per = rep["arms"][base]["per_language"]
    ref = f"{R.pct(REFERENCE_SPLIT['recall'])} % recall / {R.pct(REFERENCE_SPLIT['conversion'])} %"
    L = [
        "",
        f"## Failure breakdown, arm `{base}` (shares of wrong answers; reference: {ref} "
        "conversion)",
        "",
        "| lang | n | accuracy % | wrong | recall failures | conversion failures | unknown "
        "| recall % | conversion % | conversion failures answered in English |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = [(g, s) for g, s in per.items() if g != "en"]
    rows.append(("**non-English**", rep["arms"][base]["non_english"]))
    for g, s in rows:
        f = s["failures"]
        L.append(
            f"| {g} | {s['n']} | {R.pct(s['accuracy'])} | {f['wrong']} | {f['recall']} | "
            f"{f['conversion']} | {f['unknown']} | {R.pct(f['recall_share'])} | "
            f"{R.pct(f['conversion_share'])} | {f['answered_in_english']} |"
        )
    L += [
        "",
        f"Sensitivity (arm `{base}`): conversion share of the wrong non-English answers if the "
        f"threshold were another rank (window {lo}..{hi}); *distinct*: only items whose English "
        "and target answers start with different tokens.",
        "",
        "| threshold | wrong | conversion % | distinct | conversion % (distinct) |",
        "|---|---|---|---|---|",
    ]
    for row in sensitivity(rep, base):
        L.append(
            f"| {row['threshold']} | {row['n_wrong']} | {R.pct(row['conversion_share'])} | "
            f"{row['n_distinct']} | {R.pct(row['conversion_share_distinct'])} |"
        )
    return L


def _steering(rep: Mapping[str, Any]) -> list[str]:
    arms = rep["arms"]
    L = [
        *_heading("With steering: what each arm moves (non-English items)"),
        "| arm | accuracy % | answered in English % | recall-any % | recall failures "
        "| conversion failures | conversion share % | en formed % | median first block "
        "| fixed | broken | recall fixed | conversion fixed | recall→conversion | to English "
        "| from English |",
        "|---|" + "---|" * 15,
    ]
    for a, r in arms.items():
        s, f, t = r["non_english"], r["non_english"]["failures"], r.get(VS, {})
        tv = [str(t.get(k, "–")) for k in (
            "fixed", "broken", "recall_fixed", "conversion_fixed", "recall_to_conversion",
            "to_english", "from_english")]  # fmt: skip
        fl = s["en_first_layer_median"]
        L.append(
            f"| {a} | {R.pct(s['accuracy'])} | {R.pct(s['english_rate'])} | "
            f"{R.pct(s['recall_any'])} | {f['recall']} | {f['conversion']} | "
            f"{R.pct(f['conversion_share'])} | {R.pct(s['en_formed_share'])} | "
            f"{'–' if fl is None else fl} | " + " | ".join(tv) + " |"
        )
    if "en" in arms[base_arm(arms)]["per_language"]:
        L += ["", "English items (the vectors must not hurt English): accuracy % by arm: "]
        L[-1] += ", ".join(
            f"{a} {R.pct(r['per_language']['en']['accuracy'])}"
            for a, r in arms.items()
            if "en" in r["per_language"]
        )
    return L


def write_report(rep: Mapping[str, Any], out_dir: Any) -> Path:
    """``report.json``, ``report.md`` and the PNG figures into ``out_dir``."""
    return R.write(out_dir, rep, report_markdown(rep), figures(rep), indent=1)
