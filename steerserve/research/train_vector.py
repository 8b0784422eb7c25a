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

import json
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from steerserve.chat import chat_ids, reply_separator
from steerserve.research.hf import decoder_layers, left_padded

#: Fewer training items than this per language is refused: the vector would fit noise.
MIN_PER_LANG = 8


@dataclass
class TrainConfig:
    """What is trained, on what, and how hard."""

    layer: int
    steps: int = 60
    batch_size: int = 16
    lr: float = 0.05  # in units of the block's mean residual norm per step (Adam)
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
    sep = reply_separator(tokenizer)
    out = []
    for r in records:
        prompt = chat_ids(tokenizer, r["messages"])
        pre = r.get("reply_prefix") or ""
        head = tokenizer(sep + pre, add_special_tokens=False)["input_ids"] if pre else []
        full = tokenizer(sep + pre + r["answers"][0], add_special_tokens=False)["input_ids"]
        if full[: len(head)] != head:
            head = []
            full = tokenizer(r["answers"][0], add_special_tokens=False)["input_ids"]
        out.append(
            Item(r["id"], r["lang"], prompt + full, len(prompt) - 1, len(prompt) + len(head))
        )
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


def _batch(items: Sequence[Item], pad: int) -> tuple[dict[str, Any], torch.Tensor, list]:
    """Left-padded inputs (logits kept only for the last columns, where the gold is), the
    steering mask, and each row's (gold positions among the kept columns, gold ids)."""
    b = left_padded([it.ids for it in items], pad)
    width = b.ids.shape[1]
    keep = max(len(it.ids) - it.gold_from + 1 for it in items)
    mask = torch.zeros(len(items), width, 1)
    targets = []
    for r, it in enumerate(items):
        off = width - len(it.ids)
        mask[r, off + it.steer_from :] = 1.0
        first = off + it.gold_from - 1 - (width - keep)
        targets.append(
            (list(range(first, first + len(it.ids) - it.gold_from)), it.ids[it.gold_from :])
        )
    inputs = {"input_ids": b.ids, "attention_mask": b.mask, "position_ids": b.positions,
              "logits_to_keep": keep}  # fmt: skip
    return inputs, mask, targets


def gold_logp(logits: torch.Tensor, targets: Sequence[tuple[list[int], list[int]]]) -> torch.Tensor:
    """Per row, the mean log P of the gold tokens at their positions."""
    out = []
    for r, (pos, ids) in enumerate(targets):
        lp = torch.log_softmax(logits[r, pos].float(), -1)
        out.append(lp[torch.arange(len(ids)), torch.tensor(ids)].mean())
    return torch.stack(out)


def _forward(model: Any, hook: Steered, items: Sequence[Item], v: torch.Tensor | None):
    inputs, mask, targets = _batch(items, hook.pad)
    hook.v, hook.mask = v, mask
    return model(**inputs).logits, targets


def mean_norm(model: Any, hook: Steered, items: Sequence[Item], batch_size: int) -> float:
    """The block's mean residual norm over the steered positions (the natural unit)."""
    norms: list[torch.Tensor] = []

    def grab(module: Any, args: Any, output: Any) -> None:  # noqa: ARG001
        norms.append((output[0] if isinstance(output, tuple) else output).float().norm(dim=-1))

    h = hook.block.register_forward_hook(grab)
    total, n = 0.0, 0
    try:
        with torch.no_grad():
            for i in range(0, len(items), batch_size):
                part = items[i : i + batch_size]
                norms.clear()
                _forward(model, hook, part, None)
                mask = hook.mask
                assert mask is not None
                sel = norms[0][mask[..., 0] > 0]
                total, n = total + float(sel.sum()), n + sel.numel()
    finally:
        h.remove()
    return total / max(n, 1)


def english_reference(model: Any, hook: Steered, items: Sequence[Item], k: int) -> list:
    """Per English item, the unsteered top-``k`` tokens and probabilities at its gold positions
    (what the KL term keeps)."""
    refs = []
    with torch.no_grad():
        for it in items:
            logits, targets = _forward(model, hook, [it], None)
            probs = torch.softmax(logits[0, targets[0][0]].float(), -1)
            top = probs.topk(k, -1)
            refs.append((top.indices, top.values / top.values.sum(-1, keepdim=True)))
    return refs


def kl_english(logits: torch.Tensor, targets: Sequence, refs: Sequence) -> torch.Tensor:
    """KL(unsteered || steered) over the unsteered top tokens, mean over positions and rows."""
    out = []
    for r, ((pos, _), (idx, p)) in enumerate(zip(targets, refs, strict=True)):
        lq = torch.log_softmax(logits[r, pos].float(), -1).gather(-1, idx)
        out.append((p * (p.clamp_min(1e-12).log() - lq)).sum(-1).mean())
    return torch.stack(out).mean()


def validate(model: Any, hook: Steered, items: Sequence[Item], v: torch.Tensor, bs: int) -> float:
    """Mean gold log P of ``items`` with ``v`` added (no gradient)."""
    vals = []
    with torch.no_grad():
        for i in range(0, len(items), bs):
            logits, targets = _forward(model, hook, items[i : i + bs], v)
            vals.append(gold_logp(logits, targets))
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
    with Steered(model, cfg.layer, pad) as hook:
        unit = mean_norm(model, hook, train_items, cfg.batch_size)
        refs = english_reference(model, hook, english, cfg.top_k) if english else []
        size = model.config.get_text_config().hidden_size
        v = torch.zeros(size, requires_grad=True)
        opt = torch.optim.Adam([v], lr=cfg.lr * unit)
        curve, best, stale = Curve(), v.detach().clone(), 0
        curve.best_val = validate(model, hook, val_items, v.detach(), cfg.batch_size)
        curve.val.append((0, curve.best_val))
        t0 = time.perf_counter()
        for step in range(1, cfg.steps + 1):
            part = rng.sample(list(train_items), min(cfg.batch_size, len(train_items)))
            logits, targets = _forward(model, hook, part, v)
            loss = -gold_logp(logits, targets).mean()
            if english and cfg.kl_weight:
                pick = rng.sample(range(len(english)), min(4, len(english)))
                lg, tg = _forward(model, hook, [english[i] for i in pick], v)
                loss = loss + cfg.kl_weight * kl_english(lg, tg, [refs[i] for i in pick])
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():  # the norm cap: project back onto the ball
                cap = cfg.norm_cap * unit
                if float(v.norm()) > cap:
                    v.mul_(cap / float(v.norm()))
            curve.loss.append(float(loss.detach()))
            if step % cfg.eval_every == 0 or step == cfg.steps:
                val = validate(model, hook, val_items, v.detach(), cfg.batch_size)
                curve.val.append((step, val))
                log(f"step {step}: loss {float(loss):.3f}, val log P {val:.3f}, |v|/unit "
                    f"{float(v.norm()) / unit:.3f}, {time.perf_counter() - t0:.0f} s")  # fmt: skip
                if val > curve.best_val:
                    curve.best_val, curve.best_step, best, stale = val, step, v.detach().clone(), 0
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
