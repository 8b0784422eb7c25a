"""Headroom and oracle ceilings for residual-stream steering, before any vector sweep.

Why: a vector distilled from a prompt condition (demonstrations, asking in English, an explicit
conversion) can at most recover that condition's gain, and an edit of the last prompt token's
state can at most do what patching in the *right* state does. Measuring both says whether a
language-independent vector has anything to win on a model, with less noise than accuracy:
every condition is scored by greedy accuracy (the project's rule, ``evaluate.score``) *and* by the
teacher-forced log-probability of the gold query-language answer (max over aliases).

Model-agnostic: blocks come from the model's depth; a record is a completion ``prompt`` or chat
``messages`` (rendered by the tokenizer's chat template, answer right after the generation
prompt). Edits act on the output of decoder block L (= transformers ``hidden_states[L + 1]``), the
engine's convention. The prompt minus its last token is run once per batch and its KV cache reused
by every edit (exact: an edit at the last prompt token cannot change earlier tokens' keys and
values), so a layer sweep costs a few one-token forwards per item, not a full forward.

One module on purpose (over the usual size): the experiments share the runner and the report.
Run ``python -m steerserve.research.ceilings --help``.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import shlex
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from steerserve.chat import chat_ids, reply_separator
from steerserve.research.analyze import answer_sep, best_rank, classify, first_tokens, lens_head
from steerserve.research.extract import last_token_means, mixed_prompt, translation_chat
from steerserve.research.facts import (
    ANSWER_SEP,
    LANGS,
    RELATIONS,
    Fact,
    eval_records,
    load_facts,
    prompt,
    query,
    shots_for,
)
from steerserve.research.hf import decoder_layers, left_padded
from steerserve.research.records import form_of
from steerserve.research.replies import CHAT_BUDGET, COMPLETION_BUDGET, span_ended
from steerserve.research.report import pct, pyplot, write
from steerserve.research.scoring import (
    bootstrap_mean,
    contains,
    first_sentence,
    normalise,
    paired_bootstrap,
    score_record,
)

log = logging.getLogger("steerserve.ceilings")

# "English" and the language's own name, written in the query language (conversion prompts).
ENGLISH_IN: dict[str, str] = {
    "en": "English", "zh": "英语", "ja": "英語", "ko": "영어", "fr": "Anglais", "es": "Inglés",
    "de": "Englisch", "it": "Inglese", "ru": "Английский", "pt": "Inglês", "nl": "Engels",
    "ar": "الإنجليزية",
}  # fmt: skip
SELF_NAME: dict[str, str] = {
    "en": "English", "zh": "中文", "ja": "日本語", "ko": "한국어", "fr": "Français",
    "es": "Español", "de": "Deutsch", "it": "Italiano", "ru": "Русский", "pt": "Português",
    "nl": "Nederlands", "ar": "العربية",
}  # fmt: skip
#: The budgets of the one instrument (``replies.budget``): 8 tokens for a completion's first
#: line, 64 for a chat reply that restates the question before the name.
MAX_NEW = {"completion": COMPLETION_BUDGET, "chat": CHAT_BUDGET}


# --- prompt conditions (completion form) -------------------------------------------------------


def _label(lang: str, name: str, end: bool) -> str:
    """``name`` as a field label in the fact set's style: "英語：", "Anglais : ", "Inglés: "."""
    if lang in ("zh", "ja"):
        return name + "："
    colon = " :" if lang == "fr" else ":"
    return name + colon + ("" if end else " ")


def conversion_prompt(fact: Fact, shots: int = 3, seed: int = 0) -> str:
    """Explicit conversion, labels in the query language, the eval form's shots as demos.

    ja: ``英語：Tehran → 日本語：テヘラン\\n…英語：Amsterdam → 日本語：``; the model only has to
    write the English answer (given) in the query language: the conversion ceiling.
    """

    def line(en: str, lang: str) -> str:
        return (
            f"{_label(lang, ENGLISH_IN[lang], False)}{en} → {_label(lang, SELF_NAME[lang], True)}"
        )

    demos = [
        f"{line(s.answers_en[0], s.lang)}{ANSWER_SEP[s.lang]}{s.answers[0]}\n"
        for s in shots_for(fact, shots, seed)
    ]
    return "".join(demos) + line(fact.answers_en[0], fact.lang)


CONDITIONS: dict[str, Callable[[Fact, int], str]] = {
    "eval": lambda f, s: prompt(f, 3, s),  # (i) the evaluation form: 3-shot, query language
    "zero": lambda f, s: query(f),  # (ii) zero-shot
    "native5": lambda f, s: prompt(f, 5, s),  # (iii) 5 demonstrations in the query language
    "mixed5": lambda f, s: mixed_prompt(f, 5, s),  # (iv) 5 English demos, query-language question
    "convert": conversion_prompt,  # (vi) "English: <answer_en> → <language>:", 3-shot
}  # (v)/(vii), the same fact asked in English/Chinese, are the "eval" results of the twins


def mixed_messages(fact: Fact, k: int, seed: int = 0) -> list[dict[str, str]]:
    """Chat with ``k`` English demonstration turns, then the question in ``fact.lang``."""
    from steerserve.research.facts.chat import messages

    twins = {d.fact_id: fact_index(d.split)[f"{d.fact_id}:en"] for d in shots_for(fact, k, seed)}
    return messages(fact, k, seed, demos_from=twins)


def _chat_conditions() -> dict[str, Callable[[Fact, int], list[dict[str, str]]]]:
    from steerserve.research.facts.chat import messages

    return {
        "eval": lambda f, s: messages(f, 0, s),  # (i) the chat evaluation form: zero-shot
        "native5": lambda f, s: messages(f, 5, s),  # (iii) 5 earlier turns, query language
        "mixed5": lambda f, s: mixed_messages(f, 5, s),  # (iv) 5 English turns first
        "convert": lambda f, s: translation_chat(f, 0, s),  # (vi) "Translate into <lang>: X"
    }


def conditions(form: str) -> list[str]:
    """The prompt conditions of a form (a chat's evaluation form already is zero-shot)."""
    return list(CONDITIONS) if form == "completion" else list(_chat_conditions())


@cache
def fact_index(split: str) -> dict[str, Fact]:
    """``"<fact_id>:<lang>"`` -> Fact, the ids ``eval_records`` uses (shared: do not mutate)."""
    return {f"{f.fact_id}:{f.lang}": f for f in load_facts(split)}


def condition_records(items: Sequence[dict], facts: Mapping[str, Fact], cond: str, seed: int = 0):
    """``items`` (eval_records, either form) rewritten to condition ``cond``; answers kept."""
    out = []
    for r in items:
        f = facts[r["id"]]
        if "messages" in r:
            rec = {k: v for k, v in r.items() if k != "messages"}
            rec["messages"] = _chat_conditions()[cond](f, seed)
        else:
            rec = {**r, "prompt": CONDITIONS[cond](f, seed)}
        out.append(rec)
    return out


# --- tokens ------------------------------------------------------------------------------------


def encode(tokenizer: Any, rec: Mapping[str, Any]) -> tuple[list[int], list[list[int]]]:
    """Prompt ids (a chat rendered as the server renders it) and each distinct alias's ids as
    the model would emit them after the prompt (a completion's tokenised in context, so the
    separator merges as in generation; a chat's reply starts a fresh word after the header)."""
    if "messages" in rec:
        return _chat_encode(tokenizer, rec)
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


def _chat_encode(tokenizer: Any, rec: Mapping[str, Any]) -> tuple[list[int], list[list[int]]]:
    """A chat's prompt ids, then its ``reply_prefix`` (the model's own words before the name,
    ``prefixes.with_prefixes``) as if already generated; each alias tokenised in context after
    the prefix (where a merge across the boundary breaks that, the alias alone)."""
    sep = reply_separator(tokenizer)
    prefix = rec.get("reply_prefix") or ""
    pre = tokenizer(sep + prefix, add_special_tokens=False)["input_ids"] if prefix else []
    aliases = []
    for a in rec["answers"]:
        full = tokenizer(sep + prefix + a, add_special_tokens=False)["input_ids"]
        ok = full[: len(pre)] == pre and len(full) > len(pre)
        aliases.append(
            full[len(pre) :] if ok else tokenizer(a, add_special_tokens=False)["input_ids"]
        )
    ids = chat_ids(tokenizer, rec["messages"]) + pre
    return ids, [a for i, a in enumerate(aliases) if a and a not in aliases[:i]]


def decided(text: str, rec: Mapping[str, Any]) -> bool:
    """True once more greedy tokens cannot change whether ``text`` is correct (nor, in the
    completion form, English): a newline ended the first line; a chat reply's first sentence
    ended (its script is then fixed too) or holds a gold answer; a completion's normalised answer so far matches, or
    can no longer match, every alias."""
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


# --- edits and hooks ---------------------------------------------------------------------------


@dataclass
class Edit:
    """An edit at the output of block ``layer``: at the last prompt token ``replace`` (h <- v),
    ``add`` (h <- h + alpha v) or ``interp`` (h <- (1 - alpha) h + alpha v); with ``gen`` also
    h <- h + alpha v at every later token (the engine's ``last_prompt_and_generated``); with
    ``prompt`` also at every earlier prompt token (``all``); without ``at_last`` nothing at the
    last prompt token (``generated``). ``vec`` is ``[H]`` (one vector) or ``[N, H]`` (row i for
    item i of the run)."""

    name: str
    layer: int
    kind: str
    vec: torch.Tensor
    alpha: float = 1.0
    gen: bool = False
    prompt: bool = False
    at_last: bool = True

    def _v(self, rows: torch.Tensor) -> torch.Tensor:
        return self.vec if self.vec.dim() == 1 else self.vec[rows]

    def last(self, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        if not self.at_last:
            return h
        v = self._v(rows).to(h.dtype)
        if self.kind == "replace":
            return v.expand_as(h).clone()
        if self.kind == "add":
            return h + self.alpha * v
        if self.kind == "interp":
            return (1 - self.alpha) * h + self.alpha * v
        raise ValueError(f"unknown edit kind {self.kind!r}")

    def _added(self, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        v = self._v(rows).to(h.dtype)
        return h + self.alpha * (v.view(1, 1, -1) if v.dim() == 1 else v.unsqueeze(1))

    def later(self, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return self._added(h, rows) if self.gen else h

    def early(self, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return self._added(h, rows) if self.prompt else h


#: What one pass applies: nothing, one edit, or several (added up, in order, like engine entries).
Step = Edit | Sequence[Edit] | None


def _edits(step: Step) -> tuple[Edit, ...]:
    return () if step is None else (step,) if isinstance(step, Edit) else tuple(step)


def step_name(step: Step) -> str:
    return "+".join(e.name for e in _edits(step)) or "none"


def entry_edits(entries: Sequence[Any], vectors: Mapping[str, torch.Tensor]) -> tuple[Edit, ...]:
    """Engine steering entries (``SteeringEntry``: vector, layer, scale, positions) as one step
    of additive edits with the engine's position semantics."""
    return tuple(
        Edit(
            f"{e.vector}@{e.layer}x{e.scale:g}/{e.positions}",
            e.layer,
            "add",
            vectors[e.vector].float(),
            e.scale,
            gen=True,
            prompt=e.positions == "all",
            at_last=e.positions != "generated",
        )
        for e in entries
    )


class Hooks:
    """One forward hook per decoder block, driven by mutable fields (registered once per run).

    ``phase`` "prefix": earlier prompt tokens, edited by ``Edit.early``; "last": the last prompt
    token (one column), edited by ``Edit.last`` and captured into ``capture`` if set; "later":
    answer/generated tokens, ``Edit.later``. ``rows`` maps the current batch rows to item
    indices (for per-item vectors)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.layers = decoder_layers(model)
        self.edits: tuple[Edit, ...] = ()
        self.phase = "last"
        self.rows = torch.zeros(0, dtype=torch.long)
        self.capture: list[torch.Tensor | None] | None = None
        self._handles: list[Any] = []

    def _hook(self, i: int) -> Callable[..., Any]:
        def f(module: Any, args: Any, output: Any) -> Any:  # noqa: ARG001
            h = output[0] if isinstance(output, tuple) else output
            for e in self.edits:
                if e.layer != i:
                    continue
                if self.phase == "last":
                    h = h.clone()
                    h[:, -1] = e.last(h[:, -1], self.rows)
                elif self.phase == "prefix":
                    h = e.early(h, self.rows)
                else:
                    h = e.later(h, self.rows)
            if self.capture is not None and self.phase == "last":
                self.capture[i] = h[:, -1].detach().float().clone()
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
    """Scores records under edits: per item ``correct``/``english``/``recall_any`` (greedy, first
    line, stopped once decided), ``logp`` (sum over the gold answer's tokens, max over aliases)
    and ``logp_tok`` (per-token mean, max over aliases), and the answer ``text``."""

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
        capture: bool = False,
        progress: bool = True,
    ) -> tuple[list[list[dict]], torch.Tensor | None]:
        """Results ``[step][item]`` (a step: no edit, one, or several added up); with
        ``capture``, the last-token output of every block ``[N, L, H]`` (float32), taken in the
        first step's pass (pass ``None`` first for unedited states)."""
        enc = [encode(self.tok, r) for r in records]
        order = sorted(range(len(enc)), key=lambda i: (len(enc[i][0]), i))
        out: list[list[dict | None]] = [[None] * len(records) for _ in edits]
        states = None
        if capture:
            h = self.model.config.get_text_config().hidden_size
            states = torch.zeros(len(records), self.num_layers, h)
        t0 = time.perf_counter()
        with self.hooks.active():
            for n, b0 in enumerate(range(0, len(order), self.batch_size)):
                batch = self._prefix(
                    [order[i] for i in range(b0, min(b0 + self.batch_size, len(order)))], enc
                )
                for k, e in enumerate(edits):
                    cap = capture and k == 0
                    res = self._pass(batch, e, enc, records, cap)
                    if cap:
                        assert states is not None and self.hooks.capture is not None
                        states[batch.rows] = torch.stack(self.hooks.capture, 1)  # type: ignore[arg-type]
                        self.hooks.capture = None
                    for r, i in enumerate(batch.rows.tolist()):
                        out[k][i] = res[r]
                if progress and n % 10 == 0:
                    done = min(b0 + self.batch_size, len(order))
                    log.info("%d/%d items x %d edits, %.0f s", done, len(order), len(edits),
                             time.perf_counter() - t0)  # fmt: skip
        return out, states  # type: ignore[return-value]

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

    def _pass(self, b: _Batch, step: Step, enc: Sequence, records: Sequence, cap: bool):
        hk = self.hooks
        edits = _edits(step)
        if any(e.prompt for e in edits):  # positions "all": this step's own prompt KV
            cache = self._prefix_kv(b.ids, b.mask, b.pos, b.rows, edits)
        else:
            cache = copy.deepcopy(b.cache)
        hk.edits, hk.phase, hk.rows = edits, "last", b.rows
        hk.capture = [None] * self.num_layers if cap else None
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
        """Per row (max over aliases) the summed and the mean log P of the answer's tokens, and
        the greedy prefixes the forced pass reveals (greedy follows an alias while its argmax
        is the alias's next token; the first mismatching argmax is greedy's next token)."""
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
        """Greedy continuation per row, each stopped at EOS, ``MAX_NEW`` tokens, or once its
        score is decided. Rows the forced pass already decided cost nothing; the others decode
        (and leave the batch and the cache as they finish)."""
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


# --- statistics --------------------------------------------------------------------------------

METRICS: tuple[str, ...] = ("correct", "logp", "logp_tok", "english", "chinese", "recall_any")


def by_lang(records: Sequence[Mapping], res: Sequence[Mapping], key: str) -> dict[str, list[float]]:
    """``{lang: [value per item]}`` of one metric, languages in first-seen order."""
    out: dict[str, list[float]] = {}
    for rec, r in zip(records, res, strict=True):
        out.setdefault(rec["lang"], []).append(float(r[key]))
    return out


def _non_en(d: Mapping[str, list[float]]) -> dict[str, list[float]]:
    return {k: v for k, v in d.items() if k != "en"}


def summarise(
    records: Sequence[Mapping],
    res: Sequence[Mapping],
    base: Sequence[Mapping] | None = None,
    keys: Sequence[str] = METRICS,
) -> dict[str, Any]:
    """Per language and non-English mean (mean of language means, bootstrap 95 % CI) of every
    metric; with ``base`` (same items), paired differences with paired bootstrap CIs."""
    out: dict[str, Any] = {"n": len(res)}
    # results kept before "chinese" was scored lack it: only keys every side has
    for key in [k for k in keys if not res or (k in res[0] and (not base or k in base[0]))]:
        d = by_lang(records, res, key)
        ne = _non_en(d)
        m: dict[str, Any] = {"per_lang": {k: float(np.mean(v)) for k, v in d.items()}}
        if ne:
            m["non_en"] = float(np.mean([np.mean(v) for v in ne.values()]))
            m["non_en_ci95"] = list(bootstrap_mean(ne))
        if base is not None:
            b = by_lang(records, base, key)
            if ne:
                m["diff_non_en"] = paired_bootstrap(ne, _non_en(b))
            if "en" in d:
                m["diff_en"] = paired_bootstrap({"en": d["en"]}, {"en": b["en"]})
            m["diff_per_lang"] = {
                k: float(np.mean(v) - np.mean(b[k])) for k, v in d.items()
            }  # fmt: skip
        out[key] = m
    return out


def compact(s: Mapping[str, Any]) -> dict[str, Any]:
    """The headline numbers of a summary (non-English mean and paired difference)."""
    out: dict[str, Any] = {}
    for key in ("correct", "logp", "logp_tok"):
        m = s[key]
        out[key] = m.get("non_en")
        if "diff_non_en" in m:
            out[f"d_{key}"] = m["diff_non_en"]["diff"]
            out[f"d_{key}_ci95"] = m["diff_non_en"]["ci95"]
    return out


# --- experiments -------------------------------------------------------------------------------


def _slim(res: Sequence[Mapping]) -> list[dict]:
    return [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in res]


def cached(path: Path | None, fn: Callable[[], Any]) -> Any:
    """``fn()``, stored as JSON at ``path`` and read back from there on a rerun: a killed run
    resumes after its last finished piece."""
    if path is not None and path.is_file():
        log.info("reusing %s", path)
        return json.loads(path.read_text())
    t0 = time.perf_counter()
    out = fn()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(out, ensure_ascii=False))
        tmp.replace(path)
        _record_seconds(path, time.perf_counter() - t0)
    return out


def _record_seconds(path: Path, seconds: float) -> None:
    """Keep how long the piece at ``path`` took in its folder's ``seconds.json``, so a
    resumed run still reports the compute it took."""
    f = path.parent / "seconds.json"
    d = json.loads(f.read_text()) if f.is_file() else {}
    d[path.name] = round(seconds, 1)
    f.write_text(json.dumps(d, indent=1, sort_keys=True) + "\n")


def spent(folder: Path) -> float:
    """Seconds the pieces kept under ``folder`` took when they were computed."""
    return sum(sum(json.loads(f.read_text()).values()) for f in folder.rglob("seconds.json"))


def first_per_lang(items: Sequence[Mapping[str, Any]], n: int | None) -> list[int]:
    """Indices of the first ``n`` items of each language (all with ``None``)."""
    seen: dict[str, int] = {}
    out = []
    for i, r in enumerate(items):
        seen[r["lang"]] = seen.get(r["lang"], 0) + 1
        if n is None or seen[r["lang"]] <= n:
            out.append(i)
    return out


def headroom(
    runner: Runner,
    items: Sequence[dict],
    facts: Mapping[str, Fact],
    seed: int = 0,
    partial: Path | None = None,
    limits: Mapping[str, int] | None = None,
):
    """Step 1: every prompt condition on the same items, no vectors; paired against ``eval``
    (a condition in ``limits`` on the first N items of each language only, paired on those).
    With ``partial``, each condition's per-item results are kept there (resumable)."""
    res: dict[str, list[dict]] = {}
    idx: dict[str, list[int]] = {}
    timing: dict[str, float] = {}
    for cond in conditions("chat" if "messages" in items[0] else "completion"):
        t0 = time.perf_counter()
        idx[cond] = first_per_lang(items, None if cond == "eval" else (limits or {}).get(cond))
        sub = [items[i] for i in idx[cond]]

        def run(cond: str = cond, sub: list[dict] = sub) -> list[dict]:
            return _slim(runner.run(condition_records(sub, facts, cond, seed))[0][0])

        res[cond] = cached(None if partial is None else partial / f"{cond}.json", run)
        if len(res[cond]) == len(items) != len(sub):  # kept from a run without the limit
            idx[cond] = list(range(len(items)))
        if len(res[cond]) != len(idx[cond]):
            raise ValueError(f"{partial}/{cond}.json holds {len(res[cond])} results, not "
                             f"{len(idx[cond])}: it belongs to other items")  # fmt: skip
        timing[cond] = round(time.perf_counter() - t0, 1)
        log.info("headroom %s: %.0f s", cond, timing[cond])
    base = res["eval"]
    fid = [facts[r["id"]].fact_id for r in items]
    for twin_lang, name in (("en", "english"), ("zh", "chinese")):
        row = {
            f: i for i, (f, r) in enumerate(zip(fid, items, strict=True)) if r["lang"] == twin_lang
        }
        if row:  # (v) asked in English / (vii) asked in Chinese: the twin's eval-form result
            res[name], idx[name] = [base[row[f]] for f in fid], idx["eval"]
    out: dict[str, Any] = {
        "conditions": {
            c: summarise([items[i] for i in idx[c]], r, [base[i] for i in idx[c]])
            for c, r in res.items()
        },
        "n_items": {c: len(idx[c]) for c in res},
    }
    out["shares"] = _shares(items, res, idx)
    out["seconds"] = timing
    out["items"] = {c: _slim(r) for c, r in res.items() if c not in ("english", "chinese")}
    out["ids"] = {c: [items[i]["id"] for i in idx[c]] for c in res}
    return out


def _shares(items: Sequence[dict], res: Mapping[str, list[dict]], idx: Mapping[str, list[int]]):
    """What each ceiling could add, counted on the evaluation form's answers: the shares of
    items answered right when asked in the pivot language (English, Chinese), converted right
    when given the English answer, and both among the evaluation form's wrong answers."""
    base, conv, twin = res["eval"], res["convert"], res["english"]
    if idx["convert"] != idx["eval"]:
        raise ValueError("the conversion condition must run on every item")
    sets = {
        "eval_correct": [b["correct"] for b in base],
        "recall_any": [b["recall_any"] for b in base],
        "known_en": [t["correct"] for t in twin],
        "converts": [c["correct"] for c in conv],
        "known_en_and_converts": [t["correct"] and c["correct"] for t, c in zip(twin, conv, strict=True)],
        "wrong_but_known_en": [t["correct"] and not b["correct"] for t, b in zip(twin, base, strict=True)],
        "wrong_but_known_en_and_converts": [
            t["correct"] and c["correct"] and not b["correct"]
            for t, c, b in zip(twin, conv, base, strict=True)
        ],
    }  # fmt: skip
    if "chinese" in res:
        zh = res["chinese"]
        sets["known_zh"] = [t["correct"] for t in zh]
        sets["wrong_but_known_zh"] = [
            t["correct"] and not b["correct"] for t, b in zip(zh, base, strict=True)
        ]
    return {
        k: {**summarise(items, [{"v": float(x)} for x in v], None, ("v",))["v"]}
        for k, v in sets.items()
    }


def eval_prompt(fact: Fact, form: str, seed: int = 0) -> str | list[dict[str, str]]:
    """The evaluation form of ``fact``: the completion's 3-shot prompt, or the zero-shot chat."""
    if form == "chat":
        from steerserve.research.facts.chat import messages

        return messages(fact, 0, seed)
    return prompt(fact, 3, seed)


def relation_means(
    model: Any,
    tokenizer: Any,
    langs: Sequence[str],
    per_relation: int,
    seed: int = 0,
    form: str = "completion",
) -> dict[tuple[str, str], torch.Tensor]:
    """``(lang, relation) -> [L, H]``: mean last-token block outputs of the evaluation form
    over the first ``per_relation`` train facts of that relation in that language."""
    out = {}
    for lang in langs:
        for rel in RELATIONS:
            fs = load_facts("train", [lang], [rel])[:per_relation]
            if fs:
                ps = [eval_prompt(f, form, seed) for f in fs]
                out[(lang, rel)] = last_token_means(model, tokenizer, ps, 16, f"{lang}/{rel}")[0]
    return out


#: The pivot languages an oracle patches in, and the query languages each is tried on (None:
#: every other language). English is the paper's pivot; Chinese is where a model's Japanese and
#: Korean answers may pass (the chat model answers them in Chinese).
PIVOTS: dict[str, tuple[str, ...] | None] = {"en": None, "zh": ("ja", "ko")}
VARIANTS: tuple[str, ...] = ("replace_fact", "add_fact", "replace_rel", "add_rel")


def oracle_edits(
    layers: Sequence[int],
    h_x: torch.Tensor,
    h_p: torch.Tensor,
    rel_p: torch.Tensor,
    rel_x: torch.Tensor,
    suffix: str = "",
) -> list[Edit]:
    """Step 2's four edits per block (all ``[N, L, H]``, row i = item i; ``p`` the pivot):
    ``replace_fact`` h <- h_p (same fact, pivot-language evaluation form) at the last prompt
    token; ``add_fact`` h <- h + (h_p - h_x) at the last prompt token *and* every later token
    (at the last token the same as replacing; later tokens differ); ``replace_rel`` h <- the
    relation's mean pivot state; ``add_rel`` h <- h + (relation mean pivot - relation mean in
    the query language), last prompt and later tokens: a per-language, per-relation shift."""
    edits = []
    for ly in layers:
        edits += [
            Edit(f"replace_fact{suffix}@{ly}", ly, "replace", h_p[:, ly]),
            Edit(f"add_fact{suffix}@{ly}", ly, "add", h_p[:, ly] - h_x[:, ly], gen=True),
            Edit(f"replace_rel{suffix}@{ly}", ly, "replace", rel_p[:, ly]),
            Edit(f"add_rel{suffix}@{ly}", ly, "add", rel_p[:, ly] - rel_x[:, ly], gen=True),
        ]
    return edits


def cached_tensors(path: Path | None, fn: Callable[[], Any]) -> Any:
    """``fn()`` (tensors in plain containers) kept with ``torch.save`` (see :func:`cached`)."""
    if path is not None and path.is_file():
        log.info("reusing %s", path)
        return torch.load(path, weights_only=False)
    t0 = time.perf_counter()
    out = fn()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(out, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").replace(path)
        _record_seconds(path, time.perf_counter() - t0)
    return out


def _edit_results(res: Sequence[Sequence[Mapping]]) -> list[list[dict]]:
    return [_slim(r) for r in res]


def oracle(
    runner: Runner,
    items: Sequence[dict],
    facts: Mapping[str, Fact],
    per_relation: int = 16,
    layers: Sequence[int] | None = None,
    seed: int = 0,
    pivots: Sequence[str] = ("en",),
    partial: Path | None = None,
    group: int = 3,
) -> dict[str, Any]:
    """Step 2: patch the last prompt token's state at each block (see ``oracle_edits``), on the
    items of ``items`` whose pivot twin is there (it supplies h_p); paired against no edit.
    Blocks run ``group`` at a time; with ``partial`` each group is kept there (resumable)."""
    layers = list(range(runner.num_layers)) if layers is None else list(layers)
    form = "chat" if "messages" in items[0] else "completion"
    part = (lambda n: None) if partial is None else (lambda n: partial / n)  # noqa: E731
    t0 = time.perf_counter()

    def baseline() -> dict[str, Any]:
        runs, states = runner.run(items, [None], capture=True)
        return {"res": _slim(runs[0]), "states": states}

    base_run = cached_tensors(part("baseline.pt"), baseline)
    states = base_run["states"]
    if len(base_run["res"]) != len(items):
        raise ValueError(
            f"{partial}/baseline.pt holds {len(base_run['res'])} items, not "
            f"{len(items)}: it belongs to other items (--langs, --oracle-limit)"
        )
    fid = [facts[r["id"]].fact_id for r in items]
    langs = _langs(items)
    means = cached_tensors(
        part("relation_means.pt"),
        lambda: relation_means(runner.model, runner.tok, langs, per_relation, seed, form),
    )
    t1 = time.perf_counter()
    out: dict[str, Any] = {"layers": layers, "per_relation": per_relation, "pivots": {}}
    out["base_all_langs"] = summarise(items, base_run["res"])
    for pv in pivots:
        row = {f: i for i, (f, r) in enumerate(zip(fid, items, strict=True)) if r["lang"] == pv}
        targets = PIVOTS.get(pv)
        sel = [
            i
            for i, r in enumerate(items)
            if r["lang"] not in ("en", pv)
            and (targets is None or r["lang"] in targets)
            and fid[i] in row
        ]
        if not sel:
            continue
        recs = [items[i] for i in sel]
        h_x, h_p = states[sel], states[[row[fid[i]] for i in sel]]
        rels = [facts[r["id"]].relation for r in recs]
        rel_p = torch.stack([means[(pv, rel)] for rel in rels])
        rel_x = torch.stack([means[(r["lang"], rel)] for r, rel in zip(recs, rels, strict=True)])
        sfx = "" if pv == "en" else f".{pv}"
        mid = runner.num_layers // 2
        first: list[Edit | None] = [None, Edit(f"self{sfx}@{mid}", mid, "replace", h_x[:, mid])]
        names: list[str] = ["none", f"self{sfx}@{mid}"]
        results: list[list[dict]] = []
        for g in range(0, len(layers), group):
            lys = layers[g : g + group]
            edits = oracle_edits(lys, h_x, h_p, rel_p, rel_x, sfx)
            todo = (first if g == 0 else []) + edits
            res = cached(
                part(f"{pv}-blocks-{'-'.join(map(str, lys))}.json"),
                lambda todo=todo, recs=recs: _edit_results(runner.run(recs, todo)[0]),
            )
            names += [e.name for e in edits]
            results += res
        base = results[0]
        out["pivots"][pv] = {
            "n_items": len(recs),
            "edits": {n: summarise(recs, r, base) for n, r in zip(names, results, strict=True)},
            "items": {
                n: {"correct": [int(x["correct"]) for x in r], "logp": [x["logp"] for x in r]}
                for n, r in zip(names, results, strict=True)
            },
            "ids": [r["id"] for r in recs],
        }
    out["n_items"] = out["pivots"].get("en", {}).get("n_items", 0)
    out["seconds"] = {
        "baseline+means": round(t1 - t0, 1),
        "edits": round(time.perf_counter() - t1, 1),
    }
    return out


def pooled_train_facts(langs: Sequence[str]) -> list[Fact]:
    """Every train fact once, in one of ``langs`` in turn (fact i in ``langs[i % n]``): a
    language-independent pool of distinct facts for vector means."""
    idx = fact_index("train")
    en = load_facts("train", ["en"])
    return [idx[f"{f.fact_id}:{langs[i % len(langs)]}"] for i, f in enumerate(en)]


def pooled_means(
    model: Any, tokenizer: Any, groups: Mapping[str, Sequence[Any]], batch_size: int = 16
) -> dict[str, torch.Tensor]:
    """Mean last-token block outputs ``[L, H]`` of each prompt group."""
    return {k: last_token_means(model, tokenizer, ps, batch_size, k)[0] for k, ps in groups.items()}


def form_prompt(fact: Fact, kind: str, form: str, seed: int = 0) -> Any:
    """``fact`` as a prompt of ``kind`` in ``form``: ``zero`` (zero-shot), ``eval`` (the
    evaluation form: 3-shot completion, zero-shot chat), ``native5``/``mixed5`` (5
    query-language / English demonstrations) or ``convert0`` (zero-shot explicit conversion)."""
    if form == "chat":
        from steerserve.research.facts.chat import messages

        return {
            "zero": lambda: messages(fact, 0, seed),
            "eval": lambda: messages(fact, 0, seed),
            "native5": lambda: messages(fact, 5, seed),
            "mixed5": lambda: mixed_messages(fact, 5, seed),
            "convert0": lambda: translation_chat(fact, 0, seed),
        }[kind]()
    return {
        "zero": lambda: query(fact),
        "eval": lambda: prompt(fact, 3, seed),
        "native5": lambda: prompt(fact, 5, seed),
        "mixed5": lambda: mixed_prompt(fact, 5, seed),
        "convert0": lambda: conversion_prompt(fact, 0, seed),
    }[kind]()


def _select_confirm(
    runner: Runner,
    sel: Sequence[dict],
    conf: Sequence[dict],
    edits: Sequence[Edit],
    top: int,
    partial: Path | None = None,
) -> dict[str, Any]:
    """Run every edit on ``sel``; the ``top`` best by paired Δ mean log P(gold) (non-English)
    are run again on the disjoint ``conf`` items: noise cannot pick them twice. With
    ``partial``, the per-item results of both runs are kept there (resumable)."""
    p = (lambda n: None) if partial is None else (lambda n: partial / n)  # noqa: E731
    res = cached(p("select.json"), lambda: _edit_results(runner.run(sel, [None, *edits])[0]))
    sums = {e.name: summarise(sel, r, res[0]) for e, r in zip(edits, res[1:], strict=True)}
    best = sorted(sums, key=lambda n: -sums[n]["logp"]["diff_non_en"]["diff"])[:top]
    chosen = [e for e in edits if e.name in best]
    cres = cached(
        p(f"confirm-{'+'.join(best)}.json"),
        lambda: _edit_results(runner.run(conf, [None, *chosen])[0]),
    )
    return {
        "selection": {n: compact(v) for n, v in sums.items()},
        "selection_base": compact(summarise(sel, res[0])),
        "chosen": best,
        "confirmation": {
            e.name: summarise(conf, r, cres[0]) for e, r in zip(chosen, cres[1:], strict=True)
        },
        "confirmation_base": summarise(conf, cres[0]),
        "n_select": len(sel),
        "n_confirm": len(conf),
    }


def task_vectors(
    runner: Runner,
    sel: Sequence[dict],
    conf: Sequence[dict],
    facts: Mapping[str, Fact],
    layers: Sequence[int],
    top: int = 3,
    seed: int = 0,
    targets: Sequence[str] = ("zero", "eval"),
    sources: Sequence[str] = ("en", "native", "mixed"),
    alphas: Sequence[float] = (0.25, 0.5, 1.0),
    partial: Path | None = None,
) -> dict[str, Any]:
    """Step 3a: Hendel et al.'s task vector v = raw mean block-L last-token state of 5-shot
    prompts over the ~200 train facts (``sources``: demonstrations and question in English,
    in the query language, or English demonstrations before a query-language question;
    languages pooled), applied at the last prompt token of the ``targets`` forms (zero-shot,
    the evaluation form; a chat's are one) by interpolation h <- (1 - a) h + a v and by
    addition h <- h + (v - mean state of the target form)."""
    form = "chat" if "messages" in sel[0] else "completion"
    targets = ["eval"] if form == "chat" else list(targets)
    langs = sorted({r["lang"] for r in sel} - {"en"})
    pool = pooled_train_facts(langs)
    en = load_facts("train", ["en"])
    groups: dict[str, list[Any]] = {
        "en": [form_prompt(f, "native5", form, seed) for f in en],
        "native": [form_prompt(f, "native5", form, seed) for f in pool],
        "mixed": [form_prompt(f, "mixed5", form, seed) for f in pool],
    }
    groups = {k: v for k, v in groups.items() if k in sources}
    groups |= {t: [form_prompt(f, t, form, seed) for f in pool] for t in targets}
    t0 = time.perf_counter()
    means = cached_tensors(
        None if partial is None else partial / "means.pt",
        lambda: pooled_means(runner.model, runner.tok, groups),
    )
    out: dict[str, Any] = {"means_seconds": round(time.perf_counter() - t0, 1), "forms": {}}
    out["norms"] = {k: [round(float(v.norm()), 1) for v in m] for k, m in means.items()}
    for target in targets:
        edits = []
        for src in sources:
            for ly in layers:
                v = means[src][ly]
                edits += [Edit(f"{src}.interp{a}@{ly}", ly, "interp", v, a) for a in alphas]
                edits.append(Edit(f"{src}.add@{ly}", ly, "add", v - means[target][ly]))
        kind = "zero" if target == "zero" else "eval"
        recs_s = [{**r, **_as_prompt(form_prompt(facts[r["id"]], kind, form, seed))} for r in sel]
        recs_c = [{**r, **_as_prompt(form_prompt(facts[r["id"]], kind, form, seed))} for r in conf]
        sub = None if partial is None else partial / target
        out["forms"][target] = _select_confirm(runner, recs_s, recs_c, edits, top, sub)
    return out


def _as_prompt(p: Any) -> dict[str, Any]:
    return {"messages": p} if isinstance(p, list) else {"prompt": p}


def conversion_failures(runner: Runner, recs: Sequence[dict], res: Sequence[dict], states):
    """The diagnosis' class of every item (``analyze.classify``: a wrong answer whose English
    answer reached rank <= 10 at the last prompt token in the second half of the blocks is a
    conversion failure, else a recall failure), from the captured unedited states."""
    head = lens_head(runner.model)
    n = runner.num_layers
    out = []
    for rec, r, h in zip(recs, res, states, strict=True):
        if r["correct"]:
            out.append("correct")
            continue
        sep = answer_sep(rec, runner.tok)
        toks = first_tokens(runner.tok, rec.get("prompt"), sep, rec["answers_en"])
        ranks, _ = best_rank(head(h.to(runner.dev)).cpu(), toks)
        out.append(classify(False, np.concatenate([[np.nan], ranks]), n // 2, n - 1, 10))
    return out


def translation(
    runner: Runner,
    sel: Sequence[dict],
    conf: Sequence[dict],
    facts: Mapping[str, Fact],
    layers: Sequence[int],
    scales: Sequence[float],
    top: int = 3,
    seed: int = 0,
    partial: Path | None = None,
) -> dict[str, Any]:
    """Step 3b: d = mean(zero-shot explicit conversion prompts) - mean(zero-shot recall
    prompts) of the same ~200 train facts (languages pooled), added in natural units (scale x
    the raw difference) at the last prompt token and every later token of the eval form;
    judged on all items and on the diagnosis' conversion failures."""
    form = "chat" if "messages" in sel[0] else "completion"
    p = (lambda n: None) if partial is None else (lambda n: partial / n)  # noqa: E731
    langs = sorted({r["lang"] for r in sel} - {"en"})
    pool = pooled_train_facts(langs)
    groups = {k: [form_prompt(f, k, form, seed) for f in pool] for k in ("convert0", "zero")}
    means = cached_tensors(p("means.pt"), lambda: pooled_means(runner.model, runner.tok, groups))
    d = means["convert0"] - means["zero"]
    edits = [Edit(f"tr{s}@{ly}", ly, "add", d[ly], s, gen=True) for ly in layers for s in scales]
    recs = [{**r, **_as_prompt(form_prompt(facts[r["id"]], "eval", form, seed))} for r in sel]

    def select() -> dict[str, Any]:
        res, states = runner.run(recs, [None, *edits], capture=True)
        return {"res": _edit_results(res), "cls": conversion_failures(runner, recs, res[0], states)}

    got = cached(p("select.json"), select)
    res, cls = got["res"], got["cls"]
    conv = [i for i, c in enumerate(cls) if c == "conversion" and recs[i]["lang"] != "en"]
    sub = [recs[i] for i in conv]
    out: dict[str, Any] = {
        "d_norm": [round(float(x.norm()), 1) for x in d],
        "classes": {c: cls.count(c) for c in sorted(set(cls))},
        "all": {
            e.name: compact(summarise(recs, r, res[0])) for e, r in zip(edits, res[1:], strict=True)
        },
        "conversion": {
            e.name: compact(summarise(sub, [r[i] for i in conv], [res[0][i] for i in conv]))
            for e, r in zip(edits, res[1:], strict=True)
        }
        if conv
        else {},
        "n_select": len(recs),
        "n_conversion": len(conv),
    }
    best = sorted(out["all"], key=lambda n: -out["all"][n]["d_logp"])[:top]
    chosen = [e for e in edits if e.name in best]
    rc = [{**r, **_as_prompt(form_prompt(facts[r["id"]], "eval", form, seed))} for r in conf]
    cres = cached(
        p(f"confirm-{'+'.join(best)}.json"),
        lambda: _edit_results(runner.run(rc, [None, *chosen])[0]),
    )
    out["chosen"] = best
    out["confirmation"] = {
        e.name: summarise(rc, r, cres[0]) for e, r in zip(chosen, cres[1:], strict=True)
    }
    out["confirmation_base"] = summarise(rc, cres[0])
    out["n_confirm"] = len(rc)
    return out


# --- reports -----------------------------------------------------------------------------------

WHAT: dict[str, str] = {
    "eval": "(i) eval form: 3-shot, query language",
    "zero": "(ii) zero-shot query",
    "native5": "(iii) 5 query-language demonstrations",
    "mixed5": "(iv) 5 English demonstrations, query-language question",
    "english": "(v) same fact asked in English (English answer scored)",
    "chinese": "(vii) same fact asked in Chinese (Chinese answer scored)",
    "convert": "(vi) explicit conversion, 3-shot, labels in the query language",
}


def _ci(d: Mapping[str, Any], scale: float = 100.0, fmt: str = "{:+.1f}") -> str:
    lo, hi = d["ci95"]
    return f"{fmt.format(scale * d['diff'])} [{fmt.format(scale * lo)}, {fmt.format(scale * hi)}]"


def headroom_md(h: Mapping[str, Any]) -> list[str]:
    c = h["conditions"]
    zh = "chinese" in c["eval"]
    lines = [
        "| condition | N | non-English acc % [95 % CI] | Δ acc vs (i), pts [paired CI] | mean log "
        "P(gold) | Δ log P [paired CI] | Δ log P / token [paired CI] | English acc % | recall-any "
        "% | answered in English %" + (" | answered in Chinese % |" if zh else " |"),
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if zh else ""),
    ]
    for name, s in c.items():
        acc, lp, lpt = s["correct"], s["logp"], s["logp_tok"]
        lo, hi = acc["non_en_ci95"]
        row = [
            WHAT.get(name, name),
            str(h.get("n_items", {}).get(name, s["n"])),
            f"{pct(acc['non_en'])} [{pct(lo)}, {pct(hi)}]",
            _ci(acc["diff_non_en"]) if name != "eval" else "—",
            f"{lp['non_en']:.2f}",
            _ci(lp["diff_non_en"], 1, "{:+.2f}") if name != "eval" else "—",
            _ci(lpt["diff_non_en"], 1, "{:+.2f}") if name != "eval" else "—",
            pct(acc["per_lang"].get("en")),
            pct(s["recall_any"]["non_en"]),
            pct(s["english"]["non_en"]),
        ] + ([pct(s["chinese"]["non_en"])] if zh else [])
        lines.append("| " + " | ".join(row) + " |")
    langs = list(c["eval"]["correct"]["per_lang"])
    lines += ["", "Accuracy % per language:", ""]
    lines += ["| condition | " + " | ".join(langs) + " |", "|---" * (len(langs) + 1) + "|"]
    for name, s in c.items():
        pl = s["correct"]["per_lang"]
        lines.append(f"| {name} | " + " | ".join(pct(pl.get(g)) for g in langs) + " |")
    lines += ["", "Mean teacher-forced log P(gold) per language (nats):", ""]
    lines += ["| condition | " + " | ".join(langs) + " |", "|---" * (len(langs) + 1) + "|"]
    for name, s in c.items():
        pl = s["logp"]["per_lang"]
        cells = [f"{pl[g]:.2f}" if pl.get(g) is not None else "—" for g in langs]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Shares of the non-English items (language mean, bootstrap 95 % CI):", ""]
    lines += ["| set | % [CI] |", "|---|---|"]
    for k, s in h["shares"].items():
        lo, hi = s["non_en_ci95"]
        lines.append(f"| {k} | {pct(s['non_en'])} [{pct(lo)}, {pct(hi)}] |")
    return lines


def _best_layer(e: Mapping[str, Any], v: str, layers: Sequence[int]) -> int:
    return max(layers, key=lambda x: e[f"{v}@{x}"]["logp"]["diff_non_en"]["diff"])


def oracle_md(o: Mapping[str, Any]) -> list[str]:
    lines: list[str] = []
    for pv, po in o["pivots"].items():
        e, sfx = po["edits"], "" if pv == "en" else f".{pv}"
        langs = sorted({k for k in e["none"]["correct"]["per_lang"] if k != "en"})
        lines += [
            f"### Pivot {pv}: {po['n_items']} items ({', '.join(langs)})",
            "",
            "Paired against no edit, non-English mean; Δ accuracy in points / Δ mean log P(gold).",
            "",
        ]
        variants = [v + sfx for v in VARIANTS]
        lines += ["| block | " + " | ".join(variants) + " |", "|---" * (len(variants) + 1) + "|"]
        for ly in o["layers"]:
            cells = [
                f"{100 * e[f'{v}@{ly}']['correct']['diff_non_en']['diff']:+.1f} / "
                f"{e[f'{v}@{ly}']['logp']['diff_non_en']['diff']:+.2f}"
                for v in variants
            ]
            lines.append(f"| {ly} | " + " | ".join(cells) + " |")
        lines += ["", "Best block per edit (by Δ log P on these items, so optimistic):", ""]
        lines += ["| edit | block | Δ acc, pts [CI] | Δ log P [CI] | acc % | recall-any % |"]
        lines += ["|---|---|---|---|---|---|"]
        for v in variants:
            ly = _best_layer(e, v, o["layers"])
            sm = e[f"{v}@{ly}"]
            lines.append(
                f"| {v} | {ly} | {_ci(sm['correct']['diff_non_en'])} | "
                f"{_ci(sm['logp']['diff_non_en'], 1, '{:+.2f}')} | {pct(sm['correct']['non_en'])}"
                f" | {pct(sm['recall_any']['non_en'])} |"
            )
        b = e["none"]
        selfs = [k for k in e if k.startswith("self")]
        lines += [
            "",
            f"No edit: {pct(b['correct']['non_en'])} % non-English accuracy, mean log P "
            f"{b['logp']['non_en']:.2f}, recall-any {pct(b['recall_any']['non_en'])} %. "
            + "".join(
                f"Sanity `{k}` (replace with the item's own state): Δacc "
                f"{100 * e[k]['correct']['diff_non_en']['diff']:+.2f}, Δlog P "
                f"{e[k]['logp']['diff_non_en']['diff']:+.4f}. "
                for k in selfs
            ),
            "",
        ]
    return lines


def _compact_row(name: str, c: Mapping[str, Any]) -> str:
    return (
        f"| {name} | {100 * c['d_correct']:+.1f} [{100 * c['d_correct_ci95'][0]:+.1f}, "
        f"{100 * c['d_correct_ci95'][1]:+.1f}] | {c['d_logp']:+.3f} [{c['d_logp_ci95'][0]:+.3f}, "
        f"{c['d_logp_ci95'][1]:+.3f}] |"
    )


def _confirm_md(conf: Mapping[str, Any], base: Mapping[str, Any] | None, n: int) -> list[str]:
    lines = [f"Confirmation on {n} other items (paired against no edit on them):", ""]
    lines += ["| edit | Δ acc, pts [CI] | Δ log P [CI] | English Δ acc, pts |", "|---|---|---|---|"]
    for name, sm in conf.items():
        c = compact(sm)
        en = sm["correct"].get("diff_en", {}).get("diff")
        lines.append(_compact_row(name, c) + (f" {100 * en:+.1f} |" if en is not None else " — |"))
    if base is not None:
        lines += ["", f"No edit there: {pct(base['correct']['non_en'])} % non-English."]
    return lines


def _top_md(sel: Mapping[str, Mapping[str, Any]], k: int = 12) -> list[str]:
    lines = ["| edit | Δ acc, pts [CI] | Δ log P [CI] |", "|---|---|---|"]
    for name in sorted(sel, key=lambda n: -sel[n]["d_logp"])[:k]:
        lines.append(_compact_row(name, sel[name]))
    return lines


def taskvec_md(t: Mapping[str, Any]) -> list[str]:
    lines: list[str] = []
    for form, f in t["forms"].items():
        b = f["selection_base"]
        lines += [
            "### Applied to the "
            + (
                "zero-shot form"
                if form == "zero"
                else "evaluation form (completion: 3-shot; chat: the zero-shot chat turn)"
            ),
            "",
            f"Selection: {f['n_select']} items, no edit {pct(b['correct'])} % non-English, "
            f"mean log P {b['logp']:.2f}. Best {min(12, len(f['selection']))} of "
            f"{len(f['selection'])} edits by Δ log P:",
            "",
        ]
        lines += _top_md(f["selection"]) + [""]
        lines += _confirm_md(f["confirmation"], f["confirmation_base"], f["n_confirm"]) + [""]
    return lines


def translation_md(t: Mapping[str, Any]) -> list[str]:
    lines = [
        f"Diagnosis classes of the {t['n_select']} selection items (no edit): {t['classes']}.",
        "",
        "| edit | all: Δ acc / Δ log P | conversion failures: Δ acc / Δ log P |",
        "|---|---|---|",
    ]
    for name, a in t["all"].items():
        c = t["conversion"].get(name, {})
        conv = (
            f"{100 * c['d_correct']:+.1f} / {c['d_logp']:+.3f}"
            if c.get("d_correct") is not None
            else "—"
        )
        lines.append(f"| {name} | {100 * a['d_correct']:+.1f} / {a['d_logp']:+.3f} | {conv} |")
    lines += [""] + _confirm_md(t["confirmation"], None, t["n_confirm"])
    return lines


def _funcvec_md(e: Mapping[str, Any]) -> list[str]:
    from steerserve.research.function_vectors import funcvec_md  # imports this module

    return funcvec_md(e)


SECTIONS: dict[str, tuple[str, Callable[[Mapping[str, Any]], list[str]]]] = {
    "headroom": ("Step 1: headroom without vectors", headroom_md),
    "oracle": ("Step 2: oracle ceilings (last-prompt-token patching)", oracle_md),
    "taskvec": (
        "Step 3a: recall task vector (Hendel et al.), interpolation and addition",
        taskvec_md,
    ),
    "translation": ("Step 3b: translation difference vector, natural units", translation_md),
    "funcvec": (
        "Step 3d: function vector (Todd et al.), top heads by indirect effect",
        _funcvec_md,
    ),
}


def oracle_plot(o: Mapping[str, Any], path: Path) -> None:
    """Δ log P(gold) and Δ accuracy per block for each oracle edit and pivot."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ly = sorted(o["layers"])  # a resumed run may list new blocks after the kept ones
    for pv, po in o["pivots"].items():
        sfx = "" if pv == "en" else f".{pv}"
        for v in VARIANTS:
            for ax, key, k in ((axes[0], "logp", 1.0), (axes[1], "correct", 100.0)):
                ds = [po["edits"][f"{v}{sfx}@{x}"][key]["diff_non_en"] for x in ly]
                ax.plot(ly, [k * d["diff"] for d in ds], marker="o", label=f"{v}{sfx}",
                        ls="-" if pv == "en" else "--")  # fmt: skip
                ax.fill_between(ly, [k * d["ci95"][0] for d in ds],
                                [k * d["ci95"][1] for d in ds], alpha=0.12)  # fmt: skip
    axes[0].set(xlabel="block", ylabel="Δ mean log P(gold), non-English", title="log P")
    axes[1].set(xlabel="block", ylabel="Δ accuracy (points)", title="greedy accuracy")
    for ax in axes:
        ax.axhline(0, color="grey", lw=0.8)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(report: Mapping[str, Any], out: Path) -> None:
    """``report.json`` (everything) and ``report.md`` (commands first, then each experiment)."""
    lines = [f"# Ceilings: {report['model']}", "", "Commands (each experiment as run):", ""]
    for name, exp in report["experiments"].items():
        lines += [f"```bash\n# {name}\n{exp['command']}\n```"]
    for name, exp in report["experiments"].items():
        base, _, at = name.partition("@")
        title, fn = SECTIONS.get(base, (base, lambda e: []))
        title += f" (part {at.replace('of', '/')})" if at else ""
        lines += ["", f"## {title}", "", exp.get("setup", ""), ""]
        lines += fn(exp)
    figs = {}
    for name, exp in report["experiments"].items():
        if name.startswith("oracle") and len(exp["layers"]) > 1:
            figs[f"{name.replace('@', '-')}.png"] = lambda p, e=exp: oracle_plot(e, p)
    write(out, report, "\n".join(lines) + "\n", figs, indent=1)
    (out / "summary.json").write_text(
        json.dumps(summary_only(report), indent=1, ensure_ascii=False) + "\n", encoding="utf-8"
    )


def summary_only(d: Any) -> Any:
    """``d`` without its per-item results (``items``, ``ids``): the small, committable part of
    a report (the per-item results stay in report.json and partial/)."""
    if isinstance(d, Mapping):
        return {k: summary_only(v) for k, v in d.items() if k not in ("items", "ids")}
    if isinstance(d, list):
        return [summary_only(v) for v in d]
    return d


# --- command line ------------------------------------------------------------------------------


def load_report(out: Path) -> dict[str, Any] | None:
    """The folder's report to merge into: ``report.json``, else the committed ``summary.json``
    (report.json holds per-item results and is not committed: a fresh checkout has only the
    summary, and starting empty would drop the experiments it records from report.md)."""
    for name in ("report.json", "summary.json"):
        if (out / name).is_file():
            return json.loads((out / name).read_text(encoding="utf-8"))
    return None


def _langs(items: Sequence[Mapping[str, Any]]) -> list[str]:
    return list(dict.fromkeys(r["lang"] for r in items))


def _part(s: str) -> tuple[int, int]:
    k, n = s.split("/")
    return int(k), int(n)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m steerserve.research.ceilings",
        description="Headroom (prompt conditions) and oracle (last-token patching) ceilings "
        "for steering vectors; writes report.json and report.md to --out, merging experiments.",
    )
    p.add_argument("--model", required=True, help="local HF folder or an embedded model name")
    p.add_argument("--out", required=True, type=Path, help="report folder")
    p.add_argument(
        "--experiments",
        default="headroom,oracle",
        help="comma-separated: headroom, oracle, taskvec, translation, funcvec",
    )
    p.add_argument("--split", default="calib", help="fact split of the evaluated items")
    p.add_argument(
        "--langs",
        default=None,
        help="query languages, comma-separated (English is always added: it supplies the twins); "
        "default all 12",
    )
    p.add_argument(
        "--part",
        type=_part,
        default=(0, 1),
        help="headroom items: k/n = every n-th fact from the k-th",
    )
    p.add_argument("--limit-per-lang", type=int, default=None, help="headroom items per language")
    p.add_argument(
        "--demo-limit",
        type=int,
        default=None,
        help="run the 5-demonstration conditions (native5, mixed5) on the first N items per "
        "language only (long prompts; paired against the evaluation form on those items)",
    )
    p.add_argument("--oracle-part", type=_part, default=(0, 4), help="oracle items, as --part")
    p.add_argument("--oracle-limit", type=int, default=None, help="oracle items per language")
    p.add_argument("--per-relation", type=int, default=16, help="train facts per relation mean")
    p.add_argument("--layers", default=None, help="oracle blocks, e.g. 0,4,8 (default: all)")
    p.add_argument(
        "--pivots", default="en", help="oracle pivot languages: en, zh (zh is tried on ja, ko)"
    )
    p.add_argument(
        "--form",
        default="auto",
        choices=("auto", "completion", "chat"),
        help="prompt form (auto: chat for an instruction-tuned model's folder name)",
    )
    p.add_argument("--select-part", type=_part, default=(0, 8), help="step 3 selection items")
    p.add_argument("--confirm-part", type=_part, default=(1, 2), help="step 3 confirmation items")
    p.add_argument("--tv-layers", default="2,4,6,8,10", help="task-vector blocks")
    p.add_argument(
        "--tv-targets", default="zero,eval", help="forms task vectors are applied to (completion)"
    )
    p.add_argument("--tv-sources", default="en,native,mixed", help="task-vector demonstrations")
    p.add_argument("--tv-alphas", default="0.25,0.5,1", help="task-vector interpolation weights")
    p.add_argument("--tr-layers", default="12,13,14,15,16,17", help="translation blocks")
    p.add_argument("--tr-scales", default="0.5,1,2", help="translation scales (x raw difference)")
    p.add_argument(
        "--fv-layers", default=None, help="function-vector blocks (default: ~L/4, L/3, L/2)"
    )
    p.add_argument("--fv-scales", default="0.5,1,2,4", help="function-vector scales (x raw FV)")
    p.add_argument("--fv-heads", type=int, default=10, help="heads summed into the function vector")
    p.add_argument(
        "--fv-prompts", type=int, default=32, help="corrupted prompts the indirect effects average"
    )
    p.add_argument("--top", type=int, default=3, help="step 3 edits confirmed per search")
    p.add_argument(
        "--batch-size", type=int, default=64, help="items per forward (weights are read per call)"
    )
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0, help="demonstration seed")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    from steerserve.models import load_hf_model, resolve_model
    from steerserve.research.records import default_form

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    model, tok = load_hf_model(args.model)
    form = default_form(resolve_model(args.model), args.form)
    runner = Runner(model, tok, args.batch_size)
    facts = fact_index(args.split)
    report = load_report(args.out) or {"experiments": {}}
    report["model"] = args.model
    report["form"] = form
    command = "python -m steerserve.research.ceilings " + shlex.join(
        sys.argv[1:] if argv is None else list(argv)
    )

    def part(p: tuple[int, int]) -> str:
        return f"every {p[1]}-th fact of each relation from the {p[0]}-th, {args.split} split"

    langs = None if args.langs is None else sorted({"en", *args.langs.split(",")}, key=LANGS.index)
    for name in args.experiments.split(","):
        t0 = time.perf_counter()
        if name == "headroom":
            key = f"headroom@{args.part[0]}of{args.part[1]}"
            items = eval_records(
                args.split,
                langs=langs,
                part=args.part,
                limit_per_lang=args.limit_per_lang,
                form=form,
            )
            lim = {c: args.demo_limit for c in ("native5", "mixed5")} if args.demo_limit else None
            exp = headroom(runner, items, facts, args.seed, args.out / "partial" / key, lim)
            setup = f"{len(items)} items ({part(args.part)}; languages {', '.join(_langs(items))})."
        elif name == "oracle":
            key = f"oracle@{args.oracle_part[0]}of{args.oracle_part[1]}"
            items = eval_records(
                args.split,
                langs=langs,
                part=args.oracle_part,
                limit_per_lang=args.oracle_limit,
                form=form,
            )
            layers = None if args.layers is None else [int(x) for x in args.layers.split(",")]
            pivots = args.pivots.split(",")
            exp = oracle(runner, items, facts, args.per_relation, layers, args.seed, pivots,
                         args.out / "partial" / key)  # fmt: skip
            setup = (
                f"{len(items)} items ({part(args.oracle_part)}; languages "
                f"{', '.join(_langs(items))}); pivots {', '.join(pivots)} (zh tried on "
                f"{', '.join(PIVOTS['zh'] or ())}); relation means over {args.per_relation} train "
                "facts per relation and language."
            )
        elif name in ("taskvec", "translation", "funcvec"):
            key = name
            sel = eval_records(args.split, langs=langs, part=args.select_part, form=form)
            conf = eval_records(args.split, langs=langs, part=args.confirm_part, form=form)
            sub = args.out / "partial" / key
            if name == "taskvec":
                lys = [int(x) for x in args.tv_layers.split(",")]
                exp = task_vectors(
                    runner, sel, conf, facts, lys, args.top, args.seed,
                    args.tv_targets.split(","), args.tv_sources.split(","),
                    [float(x) for x in args.tv_alphas.split(",")], sub,
                )  # fmt: skip
            elif name == "funcvec":
                from steerserve.research.function_vectors import function_vectors

                fv_lys = (
                    None if args.fv_layers is None else [int(x) for x in args.fv_layers.split(",")]
                )
                exp = function_vectors(
                    runner, sel, conf, facts, fv_lys, [float(x) for x in args.fv_scales.split(",")],
                    args.fv_heads, args.fv_prompts, top=args.top, seed=args.seed, partial=sub,
                )  # fmt: skip
            else:
                lys = [int(x) for x in args.tr_layers.split(",")]
                scales = [float(x) for x in args.tr_scales.split(",")]
                exp = translation(runner, sel, conf, facts, lys, scales, args.top, args.seed, sub)
            setup = (
                f"Selected by paired Δ mean log P(gold) on {len(sel)} items "
                f"({part(args.select_part)}), the best {args.top} confirmed on {len(conf)} others "
                f"({part(args.confirm_part)}); languages {', '.join(_langs(sel))}, English "
                "reported apart."
            )
        else:
            raise SystemExit(f"unknown experiment {name!r}")
        exp["command"] = command
        took = spent(args.out / "partial" / key) or time.perf_counter() - t0
        exp["setup"] = setup + f" Compute: {took / 60:.0f} min ({args.threads} thread(s))."
        # another run may have written its experiment meanwhile: merge, do not overwrite
        report = load_report(args.out) or report
        report |= {"model": args.model, "form": form}
        report.setdefault("experiments", {})[key] = exp
        write_report(report, args.out)
        log.info("%s done in %.0f s -> %s", name, time.perf_counter() - t0, args.out)


if __name__ == "__main__":
    # Run the importable copy, not ``__main__``: modules that import this one (function_vectors)
    # then share its classes (``Edit``, ``Runner``), and isinstance checks hold.
    from steerserve.research import ceilings

    ceilings.main()
