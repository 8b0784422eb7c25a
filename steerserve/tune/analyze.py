"""Diagnosis: logit lens at the last prompt token and the recall / conversion failure split.

A wrong non-English answer is a conversion failure when the English answer's first token reached
rank <= ``threshold`` in the layer ``window`` (the model knew it, in English), else a recall one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from steerserve.engine.spec import PHASE_GENERATED, PHASE_LAST_PROMPT, PHASE_PROMPT
from steerserve.tune.arms import UNSTEERED, arm_entries, arm_vectors, check_arms
from steerserve.tune.hf import (
    Batch,
    decoder_layers,
    device_of,
    last_token_outputs,
    left_padded,
)
from steerserve.tune.records import answer_sep, encode, record_prompt
from steerserve.tune.reference import steering_hooks
from steerserve.tune.scorer import score_record

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
    zh_rank: np.ndarray | None = None  # the Chinese answer's, when the record has one
    zh_prob: np.ndarray | None = None
    chinese: bool = False  # answered in Chinese (scoring.RULES)


# --- tokens and ranks -------------------------------------------------------------------------


def first_tokens(tokenizer: Any, prompt: str | None, sep: str, answers: Sequence[str]) -> list[int]:
    """Each answer's first token after ``prompt``, tokenised in context so the separator merges as
    in generation (``prompt`` None: a chat reply); a whitespace-only token says nothing, dropped."""
    p_ids = tokenizer(prompt)["input_ids"] if prompt is not None else None
    out: list[int] = []
    for a in answers:
        full = tokenizer(prompt + sep + a)["input_ids"] if p_ids is not None else []
        if p_ids is not None and full[: len(p_ids)] == p_ids and len(full) > len(p_ids):
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
    prompts: Sequence[str | Sequence[int]],
    max_tokens: int,
    entries: Sequence[Any] = (),
    vectors: Mapping[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, list[str]]:
    """Last-prompt-token residuals ``[B, L + 1, H]`` (embeddings, then every block, steered) and
    the greedy continuations to a newline; prompts are text or token ids."""
    dev = device_of(model)
    ids = [tokenizer(p)["input_ids"] if isinstance(p, str) else list(p) for p in prompts]
    batch = left_padded(ids, tokenizer.pad_token_id)
    b = len(prompts)
    phases = torch.full(batch.ids.shape, PHASE_PROMPT)
    phases[:, -1] = PHASE_LAST_PROMPT
    gen_masks = torch.zeros(3, b, 1, dtype=torch.bool)
    gen_masks[PHASE_GENERATED] = True
    observed = [model.get_input_embeddings(), *decoder_layers(model)]
    steer_masks = torch.stack([phases == k for k in range(3)])
    with steering_hooks(model, entries, vectors or {}, steer_masks) as ctx:
        # opened after the steering hooks, so the capture sees the steered block outputs
        with last_token_outputs(observed) as captured:
            out = model(**batch.inputs(dev), use_cache=max_tokens > 1, logits_to_keep=1)
        hidden = torch.stack([c.cpu() for c in captured if c is not None], 1)
        ctx["masks"] = gen_masks
        gen = _greedy_tail(model, tokenizer, out, batch, max_tokens)
    eos = tokenizer.eos_token_id
    cut = [g[: g.index(eos)] if eos in g else g for g in gen]  # nothing after end of sequence
    return hidden, [tokenizer.decode(g, skip_special_tokens=True) for g in cut]


def _greedy_tail(model: Any, tokenizer: Any, out: Any, batch: Batch, steps: int) -> list[list[int]]:
    """Greedy tokens after the prompt forward ``out``, with its KV cache, until every row has a
    newline or end of sequence or ``steps`` tokens."""
    dev, eos = device_of(model), tokenizer.eos_token_id
    mask, pos = batch.mask, batch.positions
    gen: list[list[int]] = [[] for _ in range(mask.shape[0])]
    for step in range(steps):
        nxt = out.logits[:, -1].argmax(-1).cpu()
        for r, t in enumerate(nxt.tolist()):
            gen[r].append(int(t))
        done = all(eos in g or "\n" in tokenizer.decode(g) for g in gen)
        if done or step == steps - 1:
            break
        mask = torch.cat([mask, torch.ones(mask.shape[0], 1, dtype=torch.long)], 1)
        pos = pos[:, -1:] + 1
        out = model(
            input_ids=nxt[:, None].to(dev),
            attention_mask=mask.to(dev),
            position_ids=pos.to(dev),
            past_key_values=out.past_key_values,
            use_cache=True,
        )
    return gen


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
    ids = [encode(tokenizer, record_prompt(r)) for r in records]
    order = sorted(range(len(records)), key=lambda i: len(ids[i]))
    items: dict[int, Item] = {}
    for s in range(0, len(order), cfg.batch_size):
        idx = order[s : s + cfg.batch_size]
        prompts = [ids[i] for i in idx]
        hidden, texts = lens_and_greedy(model, tokenizer, prompts, cfg.max_tokens, entries, vectors)
        for r, i in enumerate(idx):
            logits = head(hidden[r].to(device_of(model))).cpu()
            items[i] = _item(tokenizer, records[i], logits, texts[r])
            items[i].cls = classify(items[i].correct, items[i].en_rank, lo, hi, cfg.threshold)
        if progress:
            progress(len(idx))
    return [items[i] for i in range(len(records))]


def _item(tokenizer: Any, rec: Mapping[str, Any], logits: torch.Tensor, reply: str) -> Item:
    """One record's lens ranks (English, target, Chinese answers) and scored greedy reply."""
    sep = answer_sep(rec, tokenizer)
    text = rec.get("prompt")  # None for a chat: its reply starts a fresh word

    def ranks(answers: Sequence[str]) -> tuple[np.ndarray, np.ndarray, list[int]]:
        toks = first_tokens(tokenizer, text, sep, answers)
        return (*best_rank(logits, toks), toks)

    en_r, en_p, en_t = ranks(rec.get("answers_en") or [])
    tg_r, tg_p, tg_t = ranks(rec["answers"])
    sc = score_record(rec, reply)
    it = Item(
        rec["id"], rec["lang"], reply.split("\n", 1)[0].strip(), sc.correct, sc.english,
        sc.recall_any, en_r, tg_r, en_p, tg_p, bool(set(en_t) & set(tg_t)), chinese=sc.chinese,
    )  # fmt: skip
    if rec.get("answers_zh"):
        it.zh_rank, it.zh_prob, _ = ranks(rec["answers_zh"])
    return it


def run(
    model: Any,
    tokenizer: Any,
    records: Sequence[Mapping[str, Any]],
    cfg: LensConfig,
    arms: Sequence[str] = (UNSTEERED,),
    artifact: Any = None,
    on_arm: Callable[[dict[str, list[Item]], dict[str, float]], None] | None = None,
) -> tuple[dict[str, list[Item]], dict[str, float]]:
    """Every arm (``arms.py``) over every record (tqdm); ``on_arm`` sees partial results after
    each arm."""
    from tqdm import tqdm

    check_arms(arms, artifact)
    vectors = arm_vectors(artifact) if artifact is not None else {}
    results: dict[str, list[Item]] = {}
    times: dict[str, float] = {}
    with tqdm(total=len(records) * len(arms), desc="analyze", unit="prompt") as bar:
        for arm in arms:
            t0 = time.perf_counter()
            entries = arm_entries(artifact, arm) if artifact is not None else ()
            bar.set_postfix(arm=arm)
            results[arm] = analyze_arm(model, tokenizer, records, cfg, entries, vectors, bar.update)
            times[arm] = round(time.perf_counter() - t0, 1)
            if on_arm is not None:
                on_arm(results, times)
    return results, times


def sample(
    records: Sequence[dict], n: int, langs: Sequence[str] | None = None, seed: int = 0
) -> list[dict]:
    """A seeded random ``n`` records per language (0: all), in file order: the facts are ordered
    by prominence, so the first N would be the easiest; the same positions in every language."""
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
