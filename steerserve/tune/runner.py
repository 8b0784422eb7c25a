"""Records scored under residual-stream edits in plain transformers (the log P and block states
an engine does not expose), the prompt's KV reused by every edit: a sweep costs one-token forwards.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from steerserve.engine.ops import DEFAULT_OP, OPS, ordered
from steerserve.engine.spec import (
    PHASE_GENERATED,
    PHASE_LAST_PROMPT,
    PHASE_PROMPT,
    POSITIONS,
    SteeringEntry,
)
from steerserve.models.chat import chat_ids, reply_separator
from steerserve.tune.hf import decoder_layers, left_padded
from steerserve.tune.records import answer_sep, form_of
from steerserve.tune.replies import CHAT_BUDGET, COMPLETION_BUDGET, span_ended
from steerserve.tune.scorer import contains, first_sentence, normalise, score_record

log = logging.getLogger("steerserve.tune.runner")

#: The budgets of the one instrument (``replies.budget``): 8 tokens for a completion's first
#: line, 64 for a chat reply that restates the question before the name.
MAX_NEW = {"completion": COMPLETION_BUDGET, "chat": CHAT_BUDGET}


def encode(tokenizer: Any, rec: Mapping[str, Any]) -> tuple[list[int], list[list[int]]]:
    """Prompt ids (a chat as the server renders it) and each distinct alias's ids as the model would
    emit them after it (a completion's in context, so the separator merges as in generation)."""
    if "messages" in rec:
        return chat_encode(tokenizer, rec)
    text = rec["prompt"]
    ids = tokenizer(text)["input_ids"]
    sep = answer_sep(rec)
    out: list[list[int]] = []
    for a in rec["answers"]:
        full = tokenizer(text + sep + a)["input_ids"]
        if full[: len(ids)] == ids and len(full) > len(ids):
            a_ids = full[len(ids) :]
        else:  # merged across the boundary: the continuation alone
            a_ids = tokenizer(sep + a, add_special_tokens=False)["input_ids"]
        if a_ids and a_ids not in out:
            out.append(a_ids)
    return ids, out


def chat_encode(tokenizer: Any, rec: Mapping[str, Any]) -> tuple[list[int], list[list[int]]]:
    """A chat's prompt ids followed by its reply prefix's, and each alias's ids
    (:func:`chat_parts`)."""
    prompt, pre, aliases = chat_parts(tokenizer, rec)
    return prompt + pre, aliases


def chat_parts(
    tokenizer: Any, rec: Mapping[str, Any]
) -> tuple[list[int], list[int], list[list[int]]]:
    """A chat's prompt ids, its ``reply_prefix`` ids as if generated, and each distinct alias in
    context after it; a space ending the prefix goes with the name, as the model writes it."""
    sep = reply_separator(tokenizer)
    whole = rec.get("reply_prefix") or ""
    prefix = whole.rstrip()
    gap = whole[len(prefix) :]
    pre = tokenizer(sep + prefix, add_special_tokens=False)["input_ids"] if prefix else []
    aliases = []
    for a in rec["answers"]:
        full = tokenizer(sep + prefix + gap + a, add_special_tokens=False)["input_ids"]
        ok = full[: len(pre)] == pre and len(full) > len(pre)
        aliases.append(
            full[len(pre) :] if ok else tokenizer(a, add_special_tokens=False)["input_ids"]
        )
    distinct = [a for i, a in enumerate(aliases) if a and a not in aliases[:i]]
    return chat_ids(tokenizer, rec["messages"]), pre, distinct


def decided(text: str, rec: Mapping[str, Any]) -> bool:
    """True once more greedy tokens cannot change whether ``text`` is correct (or English): the
    first line or chat sentence ended, or the answer so far matches (or cannot match) an alias."""
    t = text.lstrip(" \t")
    if "\n" in t:
        return True
    if "messages" in rec:  # once correct, always correct (and in the query script)
        return span_ended(text, chat=True) or contains(
            first_sentence(text), rec["answers"], rec["lang"]
        )
    p = normalise(t)
    for group in (rec["answers"], rec.get("answers_en", ())):
        gold = [a for a in map(normalise, group) if a]
        if any(p.startswith(a) for a in gold):
            return True
        if any(a.startswith(p) for a in gold):
            return False
    return True


def _bar(progress: bool | str, total: int) -> Any:
    """A tqdm bar named ``progress`` (a string), else one that shows nothing."""
    from tqdm import tqdm

    name = progress if isinstance(progress, str) else None
    return tqdm(total=total, desc=name, unit="item", disable=name is None, mininterval=2.0)


# --- edits and hooks ---------------------------------------------------------------------------


@dataclass
class Edit:
    """A steering ``entry`` applied with ``vec`` (``[H]``, or ``[N, H]``: row i for item i) on the
    tokens of its ``positions``."""

    name: str
    entry: SteeringEntry
    vec: torch.Tensor

    def __post_init__(self) -> None:
        if self.entry.op not in OPS:
            raise ValueError(f"unknown op {self.entry.op!r}; one of {', '.join(OPS)}")
        self.phases = frozenset(POSITIONS[self.entry.positions])

    def _apply(self, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        v = self.vec if self.vec.dim() == 1 else self.vec[rows]
        if v.dim() == 2 and h.dim() == 3:  # one vector per row, over its positions
            v = v.unsqueeze(1)
        v = v.to(device=h.device, dtype=torch.float32)
        return OPS[self.entry.op].reference(h, v, self.entry.scale)

    def last(self, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return self._apply(h, rows) if PHASE_LAST_PROMPT in self.phases else h

    def later(self, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return self._apply(h, rows) if PHASE_GENERATED in self.phases else h

    def early(self, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return self._apply(h, rows) if PHASE_PROMPT in self.phases else h


#: What one pass applies: nothing, one edit, or several (on one layer in the registry's order,
#: ``ops.ordered``, like engine entries).
Step = Edit | Sequence[Edit] | None


def edits_of(step: Step) -> tuple[Edit, ...]:
    return () if step is None else (step,) if isinstance(step, Edit) else tuple(step)


def _kind(e: Edit) -> str:
    return e.entry.op


def entry_edits(
    entries: Sequence[SteeringEntry], vectors: Mapping[str, torch.Tensor]
) -> tuple[Edit, ...]:
    """Engine steering entries (``SteeringEntry``) as one step of edits, their phases the
    engine's (``POSITIONS``)."""

    def label(e: SteeringEntry) -> str:
        op = "" if e.op == DEFAULT_OP else f"{e.op}:"
        return f"{op}{e.vector}@{e.layer}x{e.scale:g}/{e.positions}"

    return tuple(Edit(label(e), e, vectors[e.vector].float()) for e in entries)


class Hooks:
    """One forward hook per decoder block, driven by mutable fields: ``phase`` (prefix, last,
    later) picks the edit's method; ``rows`` maps batch rows to items (per-item vectors)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.layers = decoder_layers(model)
        self.edits: tuple[Edit, ...] = ()
        self.phase = "last"
        self.rows = torch.zeros(0, dtype=torch.long)
        self._handles: list[Any] = []

    def _hook(self, i: int) -> Callable[..., Any]:
        def f(module: Any, args: Any, output: Any) -> Any:  # noqa: ARG001
            h = output[0] if isinstance(output, tuple) else output
            for e in ordered((e for e in self.edits if e.entry.layer == i), _kind):
                if self.phase == "last":
                    h = h.clone()
                    h[:, -1] = e.last(h[:, -1], self.rows)
                elif self.phase == "prefix":
                    h = e.early(h, self.rows)
                else:
                    h = e.later(h, self.rows)
            return (h, *output[1:]) if isinstance(output, tuple) else h

        return f

    @contextmanager
    def active(self) -> Iterator[Hooks]:
        self._handles = [
            ly.register_forward_hook(self._hook(i)) for i, ly in enumerate(self.layers)
        ]
        try:
            yield self
        finally:
            for h in self._handles:
                h.remove()
            self._handles = []


# --- the runner --------------------------------------------------------------------------------


@dataclass
class _Batch:
    rows: torch.Tensor  # item indices
    ids: torch.Tensor  # [B, W] left-padded
    mask: torch.Tensor
    pos: torch.Tensor
    cache: Any  # KV of columns [:-1]


class Runner:
    """Scores records under edits: per item ``correct``/``english``/``recall_any`` (greedy, stopped
    once decided), ``logp`` and ``logp_tok`` (sum, per-token mean; max over aliases), ``text``."""

    def __init__(self, model: Any, tokenizer: Any, batch_size: int = 64) -> None:
        self.model, self.tok, self.batch_size = model, tokenizer, batch_size
        self.dev = next(model.parameters()).device
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        eos = getattr(model.generation_config, "eos_token_id", None) or tokenizer.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos])
        self.decoder, self.head = model.get_decoder(), model.get_output_embeddings()
        self.cap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
        self.hooks = Hooks(model)
        self.num_layers = len(self.hooks.layers)

    @torch.no_grad()
    def run(
        self,
        records: Sequence[Mapping[str, Any]],
        edits: Sequence[Step] = (None,),
        progress: bool | str = True,
    ) -> list[list[dict]]:
        """Results ``[step][item]`` (a step: no edit, one, or several); ``progress``: log every
        10 batches, or show a bar of that name."""
        enc = [encode(self.tok, r) for r in records]
        order = sorted(range(len(enc)), key=lambda i: (len(enc[i][0]), i))
        out: list[list[dict | None]] = [[None] * len(records) for _ in edits]
        t0 = time.perf_counter()
        bar = _bar(progress, len(order) * len(edits))
        with bar, self.hooks.active():
            for n, b0 in enumerate(range(0, len(order), self.batch_size)):
                batch = self._prefix(
                    [order[i] for i in range(b0, min(b0 + self.batch_size, len(order)))], enc
                )
                for k, e in enumerate(edits):
                    res = self._pass(batch, e, enc, records)
                    for r, i in enumerate(batch.rows.tolist()):
                        out[k][i] = res[r]
                    bar.update(len(batch.rows))
                if progress is True and n % 10 == 0:
                    done = min(b0 + self.batch_size, len(order))
                    log.info("%d/%d items x %d edits, %.0f s", done, len(order), len(edits),
                             time.perf_counter() - t0)  # fmt: skip
        return out  # type: ignore[return-value]

    def _prefix(self, idx: list[int], enc: Sequence[tuple[list[int], Any]]) -> _Batch:
        """Left-pad the batch and run every column but the last (the KV every edit reuses)."""
        b = left_padded([enc[i][0] for i in idx], self.pad)
        rows = torch.tensor(idx)
        return _Batch(
            rows, b.ids, b.mask, b.positions, self._prefix_kv(b.ids, b.mask, b.positions, rows)
        )

    def _prefix_kv(self, ids, mask, pos, rows, edits: tuple[Edit, ...] = ()) -> Any:  # noqa: ANN001
        """KV of every column but the last, with ``edits``' prompt-token additions (if any)."""
        self.hooks.edits, self.hooks.phase, self.hooks.rows = edits, "prefix", rows
        out = self.decoder(
            input_ids=ids[:, :-1].to(self.dev),
            attention_mask=mask[:, :-1].to(self.dev),
            position_ids=pos[:, :-1].to(self.dev),
            use_cache=True,
        )
        self.hooks.edits = ()
        return out.past_key_values

    def _hidden(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any):
        """Final-norm hidden states ``[R, T, H]``; the LM head runs only where it is needed (a
        262k-row head over every position would dominate a small model)."""
        return self.decoder(
            input_ids=ids.to(self.dev),
            attention_mask=mask.to(self.dev),
            position_ids=pos.to(self.dev),
            past_key_values=cache,
            use_cache=True,
        ).last_hidden_state

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """``[P, H] -> [P, V]`` float32 logits exactly as the model computes them."""
        logits = self.head(h).float()
        return torch.tanh(logits / self.cap) * self.cap if self.cap else logits

    def _forced(self, h: torch.Tensor, tgt: torch.Tensor, chunk: int = 256):
        """log P of ``tgt`` ``[R, T]`` (-1: padding, 0 there) and the argmax at every position,
        in chunks of positions (memory stays ``chunk x V``)."""
        valid = tgt >= 0
        hv, tv = h[valid.to(h.device)], tgt[valid]
        lp, am = torch.zeros(len(tv)), torch.zeros(len(tv), dtype=torch.long)
        for c in range(0, len(tv), chunk):
            logits = self._logits(hv[c : c + chunk]).cpu()
            lse = torch.logsumexp(logits, -1)
            lp[c : c + chunk] = logits.gather(1, tv[c : c + chunk, None])[:, 0] - lse
            am[c : c + chunk] = logits.argmax(-1)
        out_lp, out_am = torch.zeros(tgt.shape), torch.full(tgt.shape, -1, dtype=torch.long)
        out_lp[valid], out_am[valid] = lp, am
        return out_lp, out_am

    def _pass(self, b: _Batch, step: Step, enc: Sequence, records: Sequence):
        hk = self.hooks
        edits = edits_of(step)
        if any(
            PHASE_PROMPT in e.phases for e in edits
        ):  # positions "all": this step's own prompt KV
            cache = self._prefix_kv(b.ids, b.mask, b.pos, b.rows, edits)
        else:
            cache = copy.deepcopy(b.cache)
        hk.edits, hk.phase, hk.rows = edits, "last", b.rows
        h = self._hidden(b.ids[:, -1:], b.mask, b.pos[:, -1:], cache)[:, -1]
        lp0 = torch.log_softmax(self._logits(h), -1).cpu()
        hk.phase = "later"
        recs = [records[i] for i in b.rows.tolist()]
        logp, paths = self._teacher_forced(b, cache, lp0, [enc[i][1] for i in b.rows.tolist()])
        texts = self._greedy(b, cache, lp0, recs, paths)
        hk.edits = ()
        res = []
        for r, rec in enumerate(recs):
            s = score_record(rec, texts[r])
            res.append({"correct": s.correct, "english": s.english, "chinese": s.chinese,
                        "recall_any": s.recall_any, "logp": logp[r][0], "logp_tok": logp[r][1],
                        "text": texts[r]})  # fmt: skip
        return res

    def _teacher_forced(self, b: _Batch, cache: Any, lp0: torch.Tensor, aliases: list):
        """Per row the summed and mean log P of the answer (max over aliases), and the greedy
        prefixes the forced pass reveals (greedy follows an alias while its argmax is next)."""
        rows = [r for r, al in enumerate(aliases) for _ in al]
        seqs = [a for al in aliases for a in al]
        total = [float(lp0[r, s[0]]) for r, s in zip(rows, seqs, strict=True)]
        g0 = lp0.argmax(-1).tolist()
        paths: list[list[list[int]]] = [[[g]] for g in g0]
        argmax: dict[int, list[int]] = {}
        longer = [j for j, s in enumerate(seqs) if len(s) > 1 and s[0] == g0[rows[j]]]
        longer += [j for j, s in enumerate(seqs) if len(s) > 1 and s[0] != g0[rows[j]]]
        if longer:
            sel = torch.tensor([rows[j] for j in longer])
            c = copy.deepcopy(cache)
            c.batch_select_indices(sel.to(self.dev))
            t = max(len(seqs[j]) for j in longer) - 1
            ids = torch.full((len(longer), t), self.pad, dtype=torch.long)
            m = torch.zeros((len(longer), t), dtype=torch.long)
            for r, j in enumerate(longer):
                ids[r, : len(seqs[j]) - 1] = torch.tensor(seqs[j][:-1])
                m[r, : len(seqs[j]) - 1] = 1
            mask = torch.cat([b.mask[sel], m], 1)
            pos = b.pos[sel, -1:] + 1 + torch.arange(t)
            self.hooks.rows = b.rows[sel]
            tgt = torch.full((len(longer), t), -1, dtype=torch.long)
            for r, j in enumerate(longer):
                tgt[r, : len(seqs[j]) - 1] = torch.tensor(seqs[j][1:])
            lp, am = self._forced(self._hidden(ids, mask, pos, c), tgt)
            for r, j in enumerate(longer):
                total[j] += float(lp[r].sum())
                argmax[j] = am[r, : len(seqs[j]) - 1].tolist()
        for j, s in enumerate(seqs):
            if s[0] != g0[rows[j]]:
                continue
            path = [s[0]]
            for k, g in enumerate(argmax.get(j, [])):
                path.append(g)
                if g != s[k + 1]:
                    break
            paths[rows[j]].append(path)
        best: list[list[float]] = [[-np.inf, -np.inf] for _ in aliases]
        for r, s, v in zip(rows, seqs, total, strict=True):
            best[r] = [max(best[r][0], v), max(best[r][1], v / len(s))]
        return best, paths

    def _finished(self, tokens: list[int], rec: Mapping[str, Any]) -> tuple[bool, str]:
        """Whether greedy ``tokens`` already fix the score, and their text."""
        cap = MAX_NEW[form_of(rec)]
        ids = [t for t in tokens if t not in self.eos]
        text = self.tok.decode(ids[:cap], skip_special_tokens=True)
        done = len(ids) < len(tokens) or len(tokens) >= cap or decided(text, rec)
        return done, text

    def _greedy(self, b: _Batch, cache: Any, lp0: torch.Tensor, recs: list, paths: list) -> list:
        """Greedy continuation per row, stopped at EOS, ``MAX_NEW`` or once decided; rows the forced
        pass decided cost nothing, the others leave the batch and the cache as they finish."""
        gen = [[int(t)] for t in lp0.argmax(-1).tolist()]
        text = [""] * len(gen)
        live = []
        for r, cands in enumerate(paths):
            for p in sorted(cands, key=len, reverse=True):
                done, text[r] = self._finished(p, recs[r])
                if done:
                    break
            if not done:
                live.append(r)
        in_cache, mask = list(range(len(gen))), b.mask
        while live:
            if live != in_cache:
                keep = torch.tensor([in_cache.index(r) for r in live])
                cache.batch_select_indices(keep.to(self.dev))
                mask, in_cache = mask[keep], live
            step = len(gen[live[0]])  # every live row has as many tokens
            mask = torch.cat([mask, torch.ones(len(live), 1, dtype=torch.long)], 1)
            ids = torch.tensor([[gen[r][-1]] for r in live])
            self.hooks.rows = b.rows[live]
            h = self._hidden(ids, mask, b.pos[live, -1:] + step, cache)[:, -1]
            nxt = self._logits(h).argmax(-1)
            for r, t in zip(live, nxt.tolist(), strict=True):
                gen[r].append(int(t))
            still = []
            for r in live:
                done, text[r] = self._finished(gen[r], recs[r])
                if not done:
                    still.append(r)
            live = still
        return text
