"""Diagnosis: logit lens at the last prompt token and the recall / conversion failure split.

The paper's claim is mechanistic: a non-English query is answered by an English-centric recall
path in the middle layers and converted into the query language late. For every prompt we
project the residual stream at the last prompt token through the final norm and unembedding
(softcapping included) at the embeddings and after every block, and follow the rank and
probability of the *first token* of the English answer and of the query-language answer, as the
model would emit it after the prompt (the separator included: " Paris", or "巴黎" after "："). A
wrong non-English greedy answer is a **conversion failure** when the English answer reached
rank <= ``threshold`` somewhere in the layer ``window``, else a **recall failure**. The same runs
with the artifact's interventions (transformers hooks, positions respected) show what each moves.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from steerserve.engine.spec import PHASE_GENERATED, PHASE_LAST_PROMPT, PHASE_PROMPT
from steerserve.evaluate import score
from steerserve.facts import ANSWER_SEP
from steerserve.reference import decoder_layers, steering_hooks

ARMS: tuple[str, ...] = ("none", "recall", "translation", "both", "random")
ARM_INTERVENTIONS: dict[str, tuple[str, ...]] = {
    "none": (),
    "recall": ("recall",),
    "translation": ("translation",),
    "both": ("recall", "translation"),
    "random": ("recall", "translation"),
}
PAPER_SPLIT: dict[str, float] = {"recall": 0.78, "conversion": 0.22}  # Lu et al. 2025, errors
CLASSES: tuple[str, ...] = ("correct", "conversion", "recall", "unknown")


@dataclass
class LensConfig:
    """Classification options; the window defaults to the second half of the blocks."""

    threshold: int = 10  # 1-based rank the English answer must reach to count as "formed"
    window: tuple[int, int] | None = None  # inclusive block range; None: (n // 2, n - 1)
    max_tokens: int = 8  # greedy tokens per answer (stops at the first newline)
    batch_size: int = 8

    def blocks(self, num_layers: int) -> tuple[int, int]:
        lo, hi = self.window if self.window is not None else (num_layers // 2, num_layers - 1)
        if not 0 <= lo <= hi < num_layers:
            raise ValueError(f"window {lo}..{hi} is outside blocks 0..{num_layers - 1}")
        return lo, hi


@dataclass
class Item:
    """One prompt under one arm. Lens arrays have ``num_layers + 1`` points: index 0 is the
    embedding output, index i the output of block i - 1 (= transformers ``hidden_states[i]``)."""

    id: str
    lang: str
    answer: str
    correct: bool
    english: bool
    recall_any: bool
    en_rank: np.ndarray  # float, NaN when no informative first token
    tgt_rank: np.ndarray
    en_prob: np.ndarray
    tgt_prob: np.ndarray
    shared_first_token: bool
    cls: str = "correct"


# --- tokens and ranks -------------------------------------------------------------------------


def answer_sep(record: Mapping[str, Any]) -> str:
    """What follows the prompt before the answer: the record's ``sep``, else the fact set's."""
    if "sep" in record:
        return str(record["sep"])
    if record["prompt"][-1:].isspace():
        return ""
    return ANSWER_SEP.get(record["lang"], " ")


def first_tokens(tokenizer: Any, prompt: str, sep: str, answers: Sequence[str]) -> list[int]:
    """The first token the model would emit for each answer after ``prompt`` (deduplicated).

    The answer is tokenised in context (prompt + sep + answer) so the separator merges as in
    generation; a first token that is only whitespace ("▁" before a rare word) says nothing about
    the answer and is dropped.
    """
    p_ids = tokenizer(prompt)["input_ids"]
    out: list[int] = []
    for a in answers:
        full = tokenizer(prompt + sep + a)["input_ids"]
        if full[: len(p_ids)] == p_ids and len(full) > len(p_ids):
            t = full[len(p_ids)]
        else:  # the tokenizer merged across the boundary: the continuation alone
            cont = tokenizer(sep + a, add_special_tokens=False)["input_ids"]
            if not cont:
                continue
            t = cont[0]
        if tokenizer.decode([t]).strip() and t not in out:
            out.append(t)
    return out


def best_rank(logits: torch.Tensor, tokens: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Best (lowest) 1-based rank among ``tokens`` and its probability, per row of ``[P, V]``
    logits; NaN rank and 0 probability when ``tokens`` is empty."""
    p = logits.shape[0]
    if not tokens:
        return np.full(p, np.nan), np.zeros(p)
    lg = logits.float()
    vals = lg[:, list(tokens)]  # [P, k]
    ranks = (lg.unsqueeze(1) > vals.unsqueeze(-1)).sum(-1) + 1  # [P, k]
    probs = torch.softmax(lg, -1)[:, list(tokens)]
    return ranks.min(-1).values.double().numpy(), probs.max(-1).values.double().numpy()


def lens_head(model: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """``h [N, H] -> logits [N, V]`` exactly as the model maps its last block's output."""
    base = getattr(model, "model", model)
    norm = getattr(base, "norm", None) or base.language_model.norm
    head = model.get_output_embeddings()
    cap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)

    @torch.no_grad()
    def f(h: torch.Tensor) -> torch.Tensor:
        logits = head(norm(h)).float()
        return torch.tanh(logits / cap) * cap if cap else logits

    return f


def classify(correct: bool, en_rank: np.ndarray, lo: int, hi: int, threshold: int) -> str:
    """``correct``, or for a wrong answer ``conversion`` (English answer reached rank <=
    threshold in blocks lo..hi), ``recall`` (it never did) or ``unknown`` (no English token)."""
    if correct:
        return "correct"
    w = en_rank[lo + 1 : hi + 2]  # lens index = block + 1
    if np.isnan(w).all():
        return "unknown"
    return "conversion" if np.nanmin(w) <= threshold else "recall"


# --- the forward passes -----------------------------------------------------------------------


@torch.no_grad()
def lens_and_greedy(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    max_tokens: int,
    entries: Sequence[Any] = (),
    vectors: Mapping[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, list[str]]:
    """Last-prompt-token residuals ``[B, L + 1, H]`` (embeddings, then each block's output,
    steering included) and the greedy continuations (KV cache, stopped at a newline)."""
    layers = decoder_layers(model)
    dev = next(model.parameters()).device
    enc = [tokenizer(p)["input_ids"] for p in prompts]
    b, width = len(enc), max(len(e) for e in enc)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = tokenizer.eos_token_id
    ids = torch.full((b, width), pad, dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.long)
    for r, e in enumerate(enc):  # left padding: every last prompt token sits in column -1
        ids[r, width - len(e) :] = torch.tensor(e)
        mask[r, width - len(e) :] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    captured: list[torch.Tensor | None] = [None] * (len(layers) + 1)
    live = {"on": True}

    def grab(i: int) -> Callable[..., None]:
        def f(module: Any, args: Any, output: Any) -> None:  # noqa: ARG001
            if live["on"]:
                h = output[0] if isinstance(output, tuple) else output
                captured[i] = h[:, -1, :].float().cpu()

        return f

    phases = torch.full((b, width), PHASE_PROMPT)
    phases[:, -1] = PHASE_LAST_PROMPT
    masks = torch.stack([phases == k for k in range(3)])
    gen_masks = torch.zeros(3, b, 1, dtype=torch.bool)
    gen_masks[PHASE_GENERATED] = True
    gen: list[list[int]] = [[] for _ in range(b)]
    with steering_hooks(model, entries, vectors or {}, masks) as ctx:
        # registered after the steering hooks, so they see the steered block outputs
        handles = [model.get_input_embeddings().register_forward_hook(grab(0))]
        handles += [layer.register_forward_hook(grab(i + 1)) for i, layer in enumerate(layers)]
        try:
            out = model(
                input_ids=ids.to(dev),
                attention_mask=mask.to(dev),
                position_ids=pos.to(dev),
                use_cache=max_tokens > 1,
                logits_to_keep=1,
            )
            live["on"] = False
            ctx["masks"] = gen_masks
            for step in range(max_tokens):
                nxt = out.logits[:, -1].argmax(-1).cpu()
                for r in range(b):
                    gen[r].append(int(nxt[r]))
                done = all(eos in g or "\n" in tokenizer.decode(g) for g in gen)
                if done or step == max_tokens - 1:
                    break
                mask = torch.cat([mask, torch.ones(b, 1, dtype=torch.long)], 1)
                pos = pos[:, -1:] + 1
                out = model(
                    input_ids=nxt[:, None].to(dev),
                    attention_mask=mask.to(dev),
                    position_ids=pos.to(dev),
                    past_key_values=out.past_key_values,
                    use_cache=True,
                )
        finally:
            for hd in handles:
                hd.remove()
    hidden = torch.stack([c for c in captured if c is not None], 1)
    cut = [g[: g.index(eos)] if eos in g else g for g in gen]  # nothing after end of sequence
    return hidden, [tokenizer.decode(g, skip_special_tokens=True) for g in cut]


def analyze_arm(
    model: Any,
    tokenizer: Any,
    records: Sequence[Mapping[str, Any]],
    cfg: LensConfig,
    entries: Sequence[Any] = (),
    vectors: Mapping[str, torch.Tensor] | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[Item]:
    """Lens ranks, greedy answer and failure class of every record under one steering arm."""
    head = lens_head(model)
    n_layers = len(decoder_layers(model))
    lo, hi = cfg.blocks(n_layers)
    order = sorted(range(len(records)), key=lambda i: len(records[i]["prompt"]))
    items: dict[int, Item] = {}
    for s in range(0, len(order), cfg.batch_size):
        idx = order[s : s + cfg.batch_size]
        prompts = [records[i]["prompt"] for i in idx]
        hidden, texts = lens_and_greedy(model, tokenizer, prompts, cfg.max_tokens, entries, vectors)
        for r, i in enumerate(idx):
            rec = records[i]
            logits = head(hidden[r].to(next(model.parameters()).device)).cpu()
            sep = answer_sep(rec)
            en_t = first_tokens(tokenizer, rec["prompt"], sep, rec.get("answers_en") or [])
            tg_t = first_tokens(tokenizer, rec["prompt"], sep, rec["answers"])
            en_r, en_p = best_rank(logits, en_t)
            tg_r, tg_p = best_rank(logits, tg_t)
            sc = score(texts[r], rec["answers"], rec.get("answers_en", ()))
            it = Item(
                rec["id"], rec["lang"], texts[r].split("\n", 1)[0].strip(), sc.correct,
                sc.english, sc.recall_any, en_r, tg_r, en_p, tg_p, bool(set(en_t) & set(tg_t)),
            )  # fmt: skip
            it.cls = classify(sc.correct, en_r, lo, hi, cfg.threshold)
            items[i] = it
        if progress:
            progress(len(idx))
    return [items[i] for i in range(len(records))]


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
        if arm != "none" and "none" in results:
            a["vs_none"] = transitions(results["none"], items)
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
            }
            for it in items
        ]
        arms[arm] = a
    return {
        **meta,
        "num_layers": num_layers,
        "lens_points": ["emb"] + [str(i) for i in range(num_layers)],
        "threshold": cfg.threshold,
        "window": [lo, hi],
        "max_tokens": cfg.max_tokens,
        "paper_split": PAPER_SPLIT,
        "arms": arms,
    }


def run(
    model: Any,
    tokenizer: Any,
    records: Sequence[Mapping[str, Any]],
    cfg: LensConfig,
    arms: Sequence[str] = ("none",),
    artifact: Any = None,
    on_arm: Callable[[dict[str, list[Item]], dict[str, float]], None] | None = None,
) -> tuple[dict[str, list[Item]], dict[str, float]]:
    """Every arm over every record (tqdm); ``on_arm`` sees partial results after each arm."""
    from tqdm import tqdm

    from steerserve.evaluate import random_like

    vectors: dict[str, torch.Tensor] = {}
    if artifact is not None:
        named = artifact.named_vectors()
        vectors = dict(named)
        for i, (k, v) in enumerate(sorted(named.items())):
            vectors[f"{k}.random"] = random_like(v, 1234 + i)
    results: dict[str, list[Item]] = {}
    times: dict[str, float] = {}
    with tqdm(total=len(records) * len(arms), desc="analyze", unit="prompt") as bar:
        for arm in arms:
            t0 = time.perf_counter()
            names = ARM_INTERVENTIONS[arm]
            if names and artifact is None:
                raise ValueError(f"arm {arm!r} needs an artifact")
            entries = artifact.entries(names) if names else []
            if arm == "random":
                entries = [type(e)(f"{e.vector}.random", e.layer, e.scale, e.positions)
                           for e in entries]  # fmt: skip
            bar.set_postfix(arm=arm)
            results[arm] = analyze_arm(model, tokenizer, records, cfg, entries, vectors, bar.update)
            times[arm] = round(time.perf_counter() - t0, 1)
            if on_arm is not None:
                on_arm(results, times)
    return results, times


def sample(
    records: Sequence[dict], n: int, langs: Sequence[str] | None = None, seed: int = 0
) -> list[dict]:
    """A seeded random ``n`` records per language (0: all), kept in file order.

    The built-in facts are ordered by prominence, so the first N would be the easiest; the same
    positions are drawn for every language of equal size, so translations stay aligned.
    """
    import random

    by: dict[str, list[dict]] = {}
    for r in records:
        if not langs or r["lang"] in langs:
            by.setdefault(r["lang"], []).append(r)
    keep: set[int] = set()
    for rs in by.values():
        pos = (
            range(len(rs))
            if not n or n >= len(rs)
            else random.Random(seed).sample(range(len(rs)), n)
        )
        keep |= {id(rs[i]) for i in pos}
    return [r for r in records if id(r) in keep]


# --- report -----------------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}"


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
    base = "none" if "none" in arms else next(iter(arms))
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
            f"{formed[0] - 1}..{formed[-1] - 1}), it outranks the target answer in {_pct(min(span))}–"
            f"{_pct(max(span))} % of items (first tokens differing); at the last block in "
            f"{_pct(ab[-1])} %. (Before the answer forms, English tokens outrank others by "
            "frequency alone, so early-layer shares say little.)"
        )
    if f["wrong"]:
        out.append(
            f"- {f['wrong']} wrong non-English answers: {_pct(f['recall_share'])} % recall "
            f"failures, {_pct(f['conversion_share'])} % conversion failures (paper: "
            f"{_pct(PAPER_SPLIT['recall'])} % / {_pct(PAPER_SPLIT['conversion'])} %); "
            f"{f['answered_in_english']} of the conversion failures were answered in English; "
            f"{f['unknown']} unclassifiable."
        )
    for a, r in arms.items():
        if a == base:
            continue
        s, t = r["non_english"], r.get("vs_none", {})
        out.append(
            f"- `{a}`: accuracy {_pct(ne['accuracy'])} → {_pct(s['accuracy'])} %, answered in "
            f"English {_pct(ne['english_rate'])} → {_pct(s['english_rate'])} %, recall-any "
            f"{_pct(ne['recall_any'])} → {_pct(s['recall_any'])} %; recall failures "
            f"{f['recall']} → {s['failures']['recall']}, conversion failures {f['conversion']} → "
            f"{s['failures']['conversion']}; English answer first at rank <= {th} (median block) "
            f"{ne['en_first_layer_median']} → {s['en_first_layer_median']}"
            + (f"; fixed {t['fixed']}, broken {t['broken']}." if t else ".")
        )
    return out


def report_markdown(rep: Mapping[str, Any]) -> str:
    """Tables: rank by layer (pooled and per language), failure split, what steering moves."""
    arms = rep["arms"]
    pts = rep["lens_points"]
    lo, hi = rep["window"]
    th = rep["threshold"]
    L = [f"# Diagnosis: logit lens and recall vs conversion failures ({rep.get('model', '')})", ""]
    for k in ("dataset", "n_items", "sample_per_lang", "artifact", "interventions", "timings_s"):
        if k in rep:
            L.append(f"- **{k}**: `{json.dumps(rep[k], ensure_ascii=False)}`")
    L += [
        "",
        "**How to read.** Logit lens at the last prompt token: the residual stream after the "
        "embeddings (`emb`) and after each block `L` (= `hidden_states[L+1]`) is projected through "
        "the final norm and unembedding. *Rank* is the 1-based rank of the first token the model "
        "would emit for the answer (separator included; best-ranked alias) among "
        f"{rep.get('vocab_size', 'all')} tokens. A wrong non-English greedy answer (first line of "
        f"up to {rep['max_tokens']} tokens) is a **conversion failure** if the English answer "
        f"reached rank <= {th} in blocks {lo}..{hi}, else a **recall failure** (*unknown*: no "
        "informative English first token). Arms add the artifact's interventions with transformers "
        "hooks at their layer, scale and positions.",
        "",
        "## Findings (computed)",
        "",
        *findings(rep),
        "",
        "## Median rank by layer, non-English items pooled (English answer / target answer)",
        "",
        "*en > target*: share of items (first tokens differ) whose English answer outranks the "
        "target answer at that point.",
        "",
        "| block | " + " | ".join(f"{a}: en | {a}: target | {a}: en > target" for a in arms) + " |",
        "|---|" + "---|---|---|" * len(arms),
    ]
    for i, p in enumerate(pts):
        cells = []
        for a in arms:
            ne = arms[a]["non_english"]
            ab = ne["en_above_target_share"]
            cells += [_rk(ne["median_rank_en"][i]), _rk(ne["median_rank_target"][i])]
            cells.append(f"{_pct(ab[i])} %" if ab else "–")
        L.append(f"| {p} | " + " | ".join(cells) + " |")
    base = "none" if "none" in arms else next(iter(arms))
    per = arms[base]["per_language"]
    shown = sorted({0, lo, (lo + hi) // 2, hi - 2, hi - 1, hi} & set(range(rep["num_layers"])))
    L += [
        "",
        f"## Per language, arm `{base}`: median rank English / target at selected blocks",
        "",
        "| lang | n | "
        + " | ".join(f"block {b}" for b in shown)
        + f" | first block en rank <= {th} (median) | en formed | same first token |",
        "|---|---|" + "---|" * len(shown) + "---|---|---|",
    ]
    for g, s in per.items():
        cells = [
            f"{_rk(s['median_rank_en'][b + 1])} / {_rk(s['median_rank_target'][b + 1])}"
            for b in shown
        ]
        fl = s["en_first_layer_median"]
        L.append(
            f"| {g} | {s['n']} | " + " | ".join(cells) + f" | {'–' if fl is None else fl} | "
            f"{_pct(s['en_formed_share'])} % | {_pct(s['shared_first_token'])} % |"
        )
    L += [
        "",
        f"## Failure breakdown, arm `{base}` (shares of wrong answers; paper: "
        f"{_pct(PAPER_SPLIT['recall'])} % recall / {_pct(PAPER_SPLIT['conversion'])} % conversion)",
        "",
        "| lang | n | accuracy % | wrong | recall failures | conversion failures | unknown "
        "| recall % | conversion % | conversion failures answered in English |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = [(g, s) for g, s in per.items() if g != "en"]
    rows.append(("**non-English**", arms[base]["non_english"]))
    for g, s in rows:
        f = s["failures"]
        L.append(
            f"| {g} | {s['n']} | {_pct(s['accuracy'])} | {f['wrong']} | {f['recall']} | "
            f"{f['conversion']} | {f['unknown']} | {_pct(f['recall_share'])} | "
            f"{_pct(f['conversion_share'])} | {f['answered_in_english']} |"
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
            f"| {row['threshold']} | {row['n_wrong']} | {_pct(row['conversion_share'])} | "
            f"{row['n_distinct']} | {_pct(row['conversion_share_distinct'])} |"
        )
    L += [
        "",
        "## With steering: what each arm moves (non-English items)",
        "",
        "| arm | accuracy % | answered in English % | recall-any % | recall failures "
        "| conversion failures | conversion share % | en formed % | median first block "
        "| fixed | broken | recall fixed | conversion fixed | recall→conversion | to English "
        "| from English |",
        "|---|" + "---|" * 15,
    ]
    for a, r in arms.items():
        s, f, t = r["non_english"], r["non_english"]["failures"], r.get("vs_none", {})
        tv = [str(t.get(k, "–")) for k in (
            "fixed", "broken", "recall_fixed", "conversion_fixed", "recall_to_conversion",
            "to_english", "from_english")]  # fmt: skip
        fl = s["en_first_layer_median"]
        L.append(
            f"| {a} | {_pct(s['accuracy'])} | {_pct(s['english_rate'])} | "
            f"{_pct(s['recall_any'])} | {f['recall']} | {f['conversion']} | "
            f"{_pct(f['conversion_share'])} | {_pct(s['en_formed_share'])} | "
            f"{'–' if fl is None else fl} | " + " | ".join(tv) + " |"
        )
    if "en" in per:
        L += ["", "English items (the vectors must not hurt English): accuracy % by arm: "]
        L[-1] += ", ".join(
            f"{a} {_pct(r['per_language']['en']['accuracy'])}"
            for a, r in arms.items()
            if "en" in r["per_language"]
        )
    L += ["", "## Figures", ""]
    L += [f"![lens {a}](lens_{a}.png)" for a in arms]
    L += ["![lens by arm](lens_arms.png)", "![failures](failures.png)", ""]
    return "\n".join(L)


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _xs(rep: Mapping[str, Any]) -> list[int]:
    return list(range(-1, rep["num_layers"]))  # -1: the embeddings


def plot_lens(rep: Mapping[str, Any], arm: str, path: Any) -> None:
    """Median rank by layer, one line per language: English answer (left), target (right)."""
    plt = _plt()
    per = rep["arms"][arm]["per_language"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    cmap = plt.get_cmap("tab20")
    panels = (("median_rank_en", "English answer"), ("median_rank_target", "target answer"))
    for ax, (key, title) in zip(axes, panels, strict=True):
        for j, (g, s) in enumerate(per.items()):
            ys = [np.nan if v is None else v for v in s[key]]
            ax.plot(_xs(rep), ys, marker=".", lw=2.2 if g == "en" else 1.3, color=cmap(j), label=g)
        ax.set_yscale("log")
        ax.set_title(f"{title}: median rank of its first token")
        ax.set_xlabel("block (-1 = embeddings)")
        ax.xaxis.get_major_locator().set_params(integer=True)
        lo, hi = rep["window"]
        ax.axvspan(lo - 0.5, hi + 0.5, color="0.92", zorder=0)
        ax.axhline(rep["threshold"], color="0.5", ls=":", lw=1)
        ax.grid(alpha=0.3, which="both", lw=0.4)
    axes[0].invert_yaxis()  # rank 1 at the top (shared y axis)
    axes[0].set_ylabel("median rank (log, 1 = top)")
    axes[1].legend(fontsize=8, ncol=2, loc="lower left")
    fig.suptitle(f"logit lens at the last prompt token, arm '{arm}' (shaded: failure window)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_arms(rep: Mapping[str, Any], path: Any) -> None:
    """Non-English pooled median rank by layer per arm: English (solid) and target (dashed)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for j, (arm, r) in enumerate(rep["arms"].items()):
        ne = r["non_english"]
        c = plt.get_cmap("tab10")(j)
        for key, ls, what in (("median_rank_en", "-", "en"), ("median_rank_target", "--", "tgt")):
            ys = [np.nan if v is None else v for v in ne[key]]
            ax.plot(_xs(rep), ys, ls=ls, color=c, marker=".", label=f"{arm}: {what}")
    ax.set_yscale("log")
    ax.invert_yaxis()
    ax.set_xlabel("block (-1 = embeddings)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("median rank (log, 1 = top)")
    ax.set_title("non-English items: English answer (solid) vs target answer (dashed)")
    ax.grid(alpha=0.3, which="both", lw=0.4)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_failures(rep: Mapping[str, Any], path: Any) -> None:
    """Stacked shares correct / conversion / recall / unknown: per language (first arm) and
    pooled non-English per arm."""
    plt = _plt()
    arms = rep["arms"]
    base = "none" if "none" in arms else next(iter(arms))
    per = {g: s for g, s in arms[base]["per_language"].items() if g != "en"}
    groups = [
        (list(per), list(per.values())),
        (list(arms), [r["non_english"] for r in arms.values()]),
    ]
    fig, axes = plt.subplots(
        1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [max(len(per), 1), len(arms) + 1]}
    )
    colours = {"correct": "#4c9a2a", "conversion": "#f2a93b", "recall": "#c0392b", "unknown": "0.7"}
    for ax, (labels, sums) in zip(axes, groups, strict=True):
        bottom = np.zeros(len(labels))
        for c in CLASSES:
            ys = np.array([s["failures"][c] / max(s["n"], 1) for s in sums])
            ax.bar(labels, ys, bottom=bottom, color=colours[c], label=c)
            bottom += ys
        ax.set_ylim(0, 1)
        ax.set_ylabel("share of items")
    axes[0].set_title(f"arm '{base}': per language")
    axes[1].set_title("non-English, per arm")
    axes[1].legend(fontsize=8, loc="upper right")
    fig.suptitle(
        f"wrong answers: conversion = English answer reached rank <= {rep['threshold']} in "
        f"blocks {rep['window'][0]}..{rep['window'][1]}, recall = it never did"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(rep: Mapping[str, Any], out_dir: Any) -> Path:
    """``report.json``, ``report.md`` and the PNG figures into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(rep, indent=1, ensure_ascii=False) + "\n")
    (out / "report.md").write_text(report_markdown(rep), encoding="utf-8")
    for arm in rep["arms"]:
        plot_lens(rep, arm, out / f"lens_{arm}.png")
    plot_arms(rep, out / "lens_arms.png")
    plot_failures(rep, out / "failures.png")
    return out
