"""Every reply kept, with its verdict and whether the token budget cut it: a ruler that cuts
answers short is broken, so a run whose budget cut too many stops, naming it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from steerserve.tune.scorer import (
    Score,
    answer_span,
    ends_sentence,
    first_line,
    fold,
    score_record,
)

#: Tokens per chat reply: a restated answer needs a median 11 (ja) to 13 (ko) tokens.
CHAT_BUDGET = 64
#: Tokens per completion (the first line of a few-shot continuation is the name).
COMPLETION_BUDGET = 8
#: The scripts an answer is classed in (``scoring.Score.script``).
SCRIPTS: tuple[str, ...] = ("query", "latin", "han", "other")
#: A run whose scored spans the budget cut more often than this stops.
MAX_CUT_SHARE = 0.02


def budget(form: str, value: int = 0) -> int:
    """``value`` if given, else the form's default budget."""
    return value or (CHAT_BUDGET if form == "chat" else COMPLETION_BUDGET)


def stop_strings(form: str) -> list[str]:
    """Where a reply ends before EOS: a chat reply at a blank line, a completion at a newline."""
    return ["\n\n"] if form == "chat" else ["\n"]


@dataclass(frozen=True)
class Generation:
    """A greedy reply: its text, its token count and whether it stopped at the budget."""

    text: str
    tokens: int = 0
    hit_budget: bool = False


def span_ended(text: str, chat: bool) -> bool:
    """Whether the scored span of ``text`` is complete: its line (completion) or its first
    sentence or line (chat) ended inside the text."""
    if "\n" in text.lstrip(" \t"):
        return True
    return chat and ends_sentence(first_line(text))


def loops(text: str, longest: int = 80, least: int = 24) -> bool:
    """The reply ends in a repetition loop (a unit of up to ``longest`` characters, at least twice
    and ``least`` characters): more tokens would go on repeating, never end the answer."""
    t = text.rstrip()
    for period in range(1, min(longest, len(t) // 2) + 1):
        run = period
        while run < len(t) and t[-1 - run] == t[-1 - run + period]:
            run += 1
        if run >= max(2 * period, least):
            return True
    return False


def is_cut(gen: Generation, chat: bool) -> bool:
    """The budget stopped the reply before its scored span ended, and not in a loop (a loop is
    a wrong answer whatever the budget: counted apart, see :func:`is_loop`)."""
    return gen.hit_budget and not span_ended(gen.text, chat) and not loops(gen.text)


def is_loop(gen: Generation, chat: bool) -> bool:
    """The budget stopped a reply that was repeating itself before its scored span ended."""
    return gen.hit_budget and not span_ended(gen.text, chat) and loops(gen.text)


@dataclass(frozen=True)
class Reply:
    """One scored reply as kept in ``replies.jsonl``."""

    id: str
    lang: str
    arm: str
    text: str
    verdict: str  # correct | wrong
    why: str
    script: str  # query | latin | han | other
    tokens: int
    cut: bool
    loop: bool = False  # stopped by the budget while repeating itself (not a cut)


def why(rec: Mapping[str, Any], s: Score, span: str) -> str:
    """A short reason for the verdict, naming the answer that decided it."""
    lang = rec.get("lang")
    for key, label in (("answers", "accepted answer"), ("answers_en", "English answer")):
        f = fold(span, lang if key == "answers" else None)
        hit = next((a for a in rec.get(key) or () if fold(a, lang) and fold(a, lang) in f), None)
        if hit is not None and (key == "answers") == s.correct:
            return f"contains the {label} {hit!r}"
    if s.english:
        return "written in Latin letters, no accepted answer"
    if s.chinese:
        return "written in Chinese (Han), no accepted answer"
    return "no accepted answer in the scored span"


def judge(rec: Mapping[str, Any], arm: str, gen: Generation) -> Reply:
    """Score ``gen`` as the reply to ``rec`` under ``arm`` and keep everything about it."""
    chat = "messages" in rec
    s = score_record(rec, gen.text)
    cut, loop = is_cut(gen, chat), is_loop(gen, chat)
    reason = why(rec, s, answer_span(gen.text, chat))
    if cut:
        reason += f"; cut by the budget after {gen.tokens} tokens"
    if loop:
        reason += f"; repeating itself when the budget stopped it after {gen.tokens} tokens"
    verdict = "correct" if s.correct else "wrong"
    return Reply(
        rec["id"], rec["lang"], arm, gen.text, verdict, reason, s.script, gen.tokens, cut, loop
    )


class BudgetError(RuntimeError):
    """Too many replies were cut by the token budget: the accuracies would be wrong."""


def cut_share(cuts: Sequence[bool]) -> float:
    return sum(cuts) / len(cuts) if cuts else 0.0


def check_cuts(cuts: Sequence[bool], budget_tokens: int, limit: float = MAX_CUT_SHARE) -> None:
    """Raise :class:`BudgetError` naming the budget when more than ``limit`` were cut."""
    share = cut_share(cuts)
    if share > limit:
        raise BudgetError(
            f"{sum(cuts)} of {len(cuts)} replies ({share:.1%}) were cut by the "
            f"{budget_tokens}-token budget before their answer ended (limit {limit:.0%}): "
            "raise --max-tokens; the accuracies of this run are not trustworthy"
        )


def write_replies(path: str | Path, replies: Iterable[Reply]) -> Path:
    """``replies.jsonl``: one JSON object per reply, UTF-8, in run order."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    lines = (json.dumps(asdict(r), ensure_ascii=False) for r in replies)
    p.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return p
