"""A steering vector learned by gradient, where the answer is written (issue 20, item 3).

Extracted vectors (means, differences) are built at one position and hope to transfer; a
learned one is fitted to the outcome itself. One vector ``v`` at the output of one block,
added from the last prompt token on (``last_prompt_and_generated``, as the engine adds it),
trained to raise the log-probability of the gold name written after the model's own restated
prefix (``prefixes``), pooled over every non-English language (so still one vector for all), with
a KL term keeping English replies where they were, a norm cap in units of the block's mean
residual norm, and early stopping on items it does not train on. The result is an ordinary
artifact (one intervention, scale 1) that records its training facts, objective and curve.
"""

from __future__ import annotations

import copy
import json
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from steerserve.research.hf import decoder_layers, left_padded
from steerserve.research.runner import chat_parts

#: Fewer training items than this per language is refused: the vector would fit noise.
MIN_PER_LANG = 8


@dataclass
class TrainConfig:
    """What is trained, on what, and how hard."""

    layer: int
    steps: int = 60
    batch_size: int = 16
    lr: float = 0.05  # about how far ||v|| moves per step, in units of the mean residual norm
    norm_cap: float = 0.5  # ||v|| <= norm_cap * mean residual norm at the block
    kl_weight: float = 1.0  # English: KL(unsteered || steered) over the top tokens
    top_k: int = 64
    eval_every: int = 10
    patience: int = 3
    seed: int = 0


@dataclass
class Item:
    """One training sequence: prompt + own prefix + gold name, where steering starts and
    where the gold starts."""

    id: str
    lang: str
    ids: list[int]
    steer_from: int  # the last prompt token
    gold_from: int  # first gold token


@dataclass
class Curve:
    """The training record: loss per step and validation log P per check."""

    loss: list[float] = field(default_factory=list)
    val: list[tuple[int, float]] = field(default_factory=list)
    best_step: int = 0
    best_val: float = -math.inf


def items_of(tokenizer: Any, records: Sequence[Mapping[str, Any]]) -> list[Item]:
    """Chat records with ``reply_prefix`` as training sequences (the first accepted answer is
    the target; an English record's target is its English answer, for the KL term only)."""
    out = []
    for r in records:
        prompt, pre, aliases = chat_parts(tokenizer, r)  # the one rule for a prefix and its name
        ids = prompt + pre
        out.append(Item(r["id"], r["lang"], ids + aliases[0], len(prompt) - 1, len(ids)))
    return out


def check_training_set(records: Sequence[Mapping[str, Any]], min_per_lang: int = MIN_PER_LANG):
    """Refuse records without gold answers, or a language with too few items to learn from."""
    counts: dict[str, int] = {}
    for r in records:
        if not r.get("answers"):
            raise ValueError(f"record {r.get('id')!r} has no gold answer to train on")
        counts[r["lang"]] = counts.get(r["lang"], 0) + 1
    few = {k: n for k, n in counts.items() if k != "en" and n < min_per_lang}
    if few or not any(k != "en" for k in counts):
        raise ValueError(
            f"too few non-English training items per language (need {min_per_lang}): {few or counts}"
        )


class Steered:
    """A forward hook adding ``v`` at block ``layer``'s output from each row's ``steer_from``."""

    def __init__(self, model: Any, layer: int, pad: int = 0) -> None:
        self.block = decoder_layers(model)[layer]
        self.pad = pad
        self.v: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None  # [B, T, 1]

    def __enter__(self) -> Steered:
        def hook(module: Any, args: Any, output: Any) -> Any:  # noqa: ARG001
            if self.v is None or self.mask is None:
                return output
            h = output[0] if isinstance(output, tuple) else output
            h = h + self.mask.to(h.dtype) * self.v.to(h.dtype)
            return (h, *output[1:]) if isinstance(output, tuple) else h

        self._handle = self.block.register_forward_hook(hook)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._handle.remove()


@dataclass
class Prepared:
    """A fixed batch: the KV cache of its prompts but their last token (computed once, no
    gradient: the vector starts at the last prompt token, so nothing before it changes), and the
    suffix every step runs with the vector (last prompt token, own prefix, gold)."""

    items: list[Item]
    cache: Any
    ids: torch.Tensor  # [B, S] suffix, right-padded
    mask: torch.Tensor  # [B, P + S] attention mask over cached prompt and suffix
    pos: torch.Tensor  # [B, S]
    steer: torch.Tensor  # [B, S, 1] the suffix's real tokens
    targets: list[tuple[list[int], list[int]]]  # per row: suffix positions predicting gold, ids


def prepare(model: Any, items: Sequence[Item], batch_size: int, pad: int) -> list[Prepared]:
    """``items`` in fixed batches, their prompt KV computed once."""
    out = []
    for i in range(0, len(items), batch_size):
        part = list(items[i : i + batch_size])
        b = left_padded([it.ids[: it.steer_from] for it in part], pad)
        with torch.no_grad():
            cache = model.model(input_ids=b.ids, attention_mask=b.mask, position_ids=b.positions,
                                use_cache=True).past_key_values  # fmt: skip
        suffix = [it.ids[it.steer_from :] for it in part]
        width = max(map(len, suffix))
        ids = torch.full((len(part), width), pad, dtype=torch.long)
        steer = torch.zeros(len(part), width, 1)
        targets = []
        for r, (it, suf) in enumerate(zip(part, suffix, strict=True)):
            ids[r, : len(suf)] = torch.tensor(suf)
            steer[r, : len(suf)] = 1.0
            g = it.gold_from - it.steer_from
            targets.append((list(range(g - 1, len(suf) - 1)), suf[g:]))
        pos = b.mask.sum(1, keepdim=True) + torch.arange(width)
        mask = torch.cat([b.mask, steer[..., 0].long()], 1)
        out.append(Prepared(part, cache, ids, mask, pos, steer, targets))
    return out


def gold_logp(logits: torch.Tensor, targets: Sequence[tuple[list[int], list[int]]]) -> torch.Tensor:
    """Per row, the mean log P of the gold tokens at their positions."""
    out = []
    for r, (pos, ids) in enumerate(targets):
        lp = torch.log_softmax(logits[r, pos].float(), -1)
        out.append(lp[torch.arange(len(ids)), torch.tensor(ids)].mean())
    return torch.stack(out)


def _forward(model: Any, hook: Steered, batch: Prepared, v: torch.Tensor | None) -> torch.Tensor:
    """Logits of the batch's suffix with ``v`` added at every suffix token (None: unsteered)."""
    hook.v, hook.mask = v, batch.steer
    return model(input_ids=batch.ids, attention_mask=batch.mask, position_ids=batch.pos,
                 past_key_values=copy.deepcopy(batch.cache), use_cache=True).logits  # fmt: skip


def mean_norm(model: Any, hook: Steered, batches: Sequence[Prepared]) -> float:
    """The block's mean residual norm over the steered positions (the natural unit)."""
    norms: list[torch.Tensor] = []

    def grab(module: Any, args: Any, output: Any) -> None:  # noqa: ARG001
        norms.append((output[0] if isinstance(output, tuple) else output).float().norm(dim=-1))

    h = hook.block.register_forward_hook(grab)
    total, n = 0.0, 0
    try:
        with torch.no_grad():
            for b in batches:
                norms.clear()
                _forward(model, hook, b, None)
                sel = norms[0][b.steer[..., 0] > 0]
                total, n = total + float(sel.sum()), n + sel.numel()
    finally:
        h.remove()
    return total / max(n, 1)


def english_reference(model: Any, hook: Steered, batches: Sequence[Prepared], k: int) -> list:
    """Per English batch and row, the unsteered top-``k`` tokens and probabilities at its gold
    positions (what the KL term keeps)."""
    refs = []
    with torch.no_grad():
        for b in batches:
            logits = _forward(model, hook, b, None)
            rows = []
            for r, (pos, _) in enumerate(b.targets):
                top = torch.softmax(logits[r, pos].float(), -1).topk(k, -1)
                rows.append((top.indices, top.values / top.values.sum(-1, keepdim=True)))
            refs.append(rows)
    return refs


def kl_english(logits: torch.Tensor, targets: Sequence, refs: Sequence) -> torch.Tensor:
    """KL(unsteered || steered) over the unsteered top tokens, mean over positions and rows."""
    out = []
    for r, ((pos, _), (idx, p)) in enumerate(zip(targets, refs, strict=True)):
        lq = torch.log_softmax(logits[r, pos].float(), -1).gather(-1, idx)
        out.append((p * (p.clamp_min(1e-12).log() - lq)).sum(-1).mean())
    return torch.stack(out).mean()


def validate(model: Any, hook: Steered, batches: Sequence[Prepared], v: torch.Tensor) -> float:
    """Mean gold log P over ``batches`` with ``v`` added (no gradient)."""
    with torch.no_grad():
        vals = [gold_logp(_forward(model, hook, b, v), b.targets) for b in batches]
    return float(torch.cat(vals).mean())


def train(
    model: Any,
    tokenizer: Any,
    train_items: Sequence[Item],
    val_items: Sequence[Item],
    english: Sequence[Item],
    cfg: TrainConfig,
    log: Callable[[str], None] = print,
) -> tuple[torch.Tensor, Curve, float]:
    """The learned vector (best on ``val_items``), its training curve, and the block's mean
    residual norm (the unit of ``lr`` and ``norm_cap``)."""
    for p in model.parameters():
        p.requires_grad_(False)
    rng = random.Random(cfg.seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    shuffled = list(train_items)
    rng.shuffle(shuffled)  # fixed batches mixing languages and relations
    with Steered(model, cfg.layer, pad) as hook:
        tr = prepare(model, shuffled, cfg.batch_size, pad)
        val = prepare(model, val_items, cfg.batch_size, pad)
        en = prepare(model, english, max(1, cfg.batch_size // 4), pad) if english else []
        unit = mean_norm(model, hook, tr)
        refs = english_reference(model, hook, en, cfg.top_k)
        size = model.config.get_text_config().hidden_size
        v = torch.zeros(size, requires_grad=True)
        # Adam moves every coordinate by about lr: lr * unit / sqrt(size) moves ||v|| by about
        # lr * unit per step (a first try at lr * unit moved it by twice the norm cap at once)
        opt = torch.optim.Adam([v], lr=cfg.lr * unit / math.sqrt(size))
        curve, best, stale = Curve(), v.detach().clone(), 0
        curve.best_val = validate(model, hook, val, v.detach())
        curve.val.append((0, curve.best_val))
        log(f"step 0: val log P {curve.best_val:.3f} (unsteered), residual norm {unit:.1f}")
        t0 = time.perf_counter()
        for step in range(1, cfg.steps + 1):
            b = tr[rng.randrange(len(tr))]
            loss = -gold_logp(_forward(model, hook, b, v), b.targets).mean()
            if en and cfg.kl_weight:
                j = rng.randrange(len(en))
                loss = loss + cfg.kl_weight * kl_english(
                    _forward(model, hook, en[j], v), en[j].targets, refs[j]
                )
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():  # the norm cap: project back onto the ball
                cap = cfg.norm_cap * unit
                if float(v.norm()) > cap:
                    v.mul_(cap / float(v.norm()))
            curve.loss.append(float(loss.detach()))
            if step % cfg.eval_every == 0 or step == cfg.steps:
                score = validate(model, hook, val, v.detach())
                curve.val.append((step, score))
                log(f"step {step}: loss {curve.loss[-1]:.3f}, val log P {score:.3f}, |v|/unit "
                    f"{float(v.norm()) / unit:.3f}, {time.perf_counter() - t0:.0f} s")  # fmt: skip
                if score > curve.best_val:
                    curve.best_val, curve.best_step, best, stale = (
                        score,
                        step,
                        v.detach().clone(),
                        0,
                    )
                else:
                    stale += 1
                    if stale >= cfg.patience:
                        break
    return best, curve, unit


def provenance(cfg: TrainConfig, train_ids: Sequence[str], val_ids: Sequence[str],
               curve: Curve, unit: float, notes: Mapping[str, Any]) -> dict[str, Any]:  # fmt: skip
    """What the artifact records about how its vector was made."""
    return {
        "construction": "learned: one vector at one block, gradient on the gold name's log P "
        "after the model's own restated prefix, pooled over the non-English languages, KL on "
        "English, norm cap, early stop on held-aside items (steerserve train-vector)",
        "objective": "maximise mean log P(gold tokens | prompt + own prefix) over non-English "
        f"items - {cfg.kl_weight} x KL(unsteered || steered) on English items (top {cfg.top_k})",
        "config": asdict(cfg),
        "mean_residual_norm": unit,
        "train_items": list(train_ids),
        "validation_items": list(val_ids),
        "curve": {"loss": curve.loss, "val": curve.val, "best_step": curve.best_step},
        **notes,
    }


def write_curve(path: Path, curve: Curve) -> None:
    path.write_text(json.dumps(asdict(curve), indent=1) + "\n", encoding="utf-8")
