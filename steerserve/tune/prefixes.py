"""The answer position of a chat reply: the model's own words before the name, where the gold
name is forced (right after the prompt it rewards vectors that only change the format).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any

from steerserve.tune.facts import Fact, load_facts
from steerserve.tune.scorer import first_sentence


def restated_prefix(rec: Mapping[str, Any], reply: str) -> str | None:
    """``reply`` up to the first answer it names (accepted, English or Chinese) in its first
    sentence, or None when it names none of them."""
    span = first_sentence(reply).casefold()
    names = [*rec["answers"], *rec.get("answers_en", ()), *rec.get("answers_zh", ())]
    hits = [i for i in (span.find(n.casefold()) for n in names if n) if i >= 0]
    return reply.lstrip(" \t")[: min(hits)] if hits else None


_SUBJECT = "\x00"  # where a template's subject goes


@cache
def _facts() -> dict[str, Fact]:
    return {f"{f.fact_id}:{f.lang}": f for f in load_facts()}


def _key(rec: Mapping[str, Any]) -> tuple[str, str]:
    return rec["id"].split(":", 1)[0], rec["lang"]


def echoed_prefix(rec: Mapping[str, Any], reply: str) -> str | None:
    """For a reply naming no known answer: its start as far as it echoes the question past the
    subject ("헝가리의 수도는 " of "헝가리의 수도는 뉴욕입니다."); else None."""
    f = _facts().get(rec["id"])
    question = rec["messages"][-1]["content"] if rec.get("messages") else ""
    sent = first_sentence(reply.lstrip(" \t"))
    echo = os.path.commonprefix([sent, question])
    if f is None or (at := echo.find(f.subject)) < 0 or len(echo) <= at + len(f.subject):
        return None
    return echo


def with_prefixes(records: Sequence[Mapping[str, Any]], replies: Sequence[str]) -> list[dict]:
    """``records`` with ``reply_prefix`` and its ``prefix_source``: ``own``, ``echo`` (as far as
    it echoes the question), ``template`` (a sibling's reply, subject swapped) or ``none``."""
    own = [restated_prefix(r, t) for r, t in zip(records, replies, strict=True)]
    echoed = [echoed_prefix(r, t) for r, t in zip(records, replies, strict=True)]
    facts = _facts()
    templates: dict[tuple[str, str], str] = {}
    for r, p in zip(records, own, strict=True):
        f = facts.get(r["id"])
        if p and f is not None and f.subject in p:
            templates.setdefault(_key(r), p.replace(f.subject, _SUBJECT, 1))
    out = []
    for r, p in zip(records, own, strict=True):
        f, tpl = facts.get(r["id"]), templates.get(_key(r))
        if p is not None:
            out.append({**r, "reply_prefix": p, "prefix_source": "own"})
        elif (q := echoed[len(out)]) is not None:
            out.append({**r, "reply_prefix": q, "prefix_source": "echo"})
        elif f is not None and tpl is not None:
            pre = tpl.replace(_SUBJECT, f.subject)
            out.append({**r, "reply_prefix": pre, "prefix_source": "template"})
        else:
            out.append({**r, "reply_prefix": "", "prefix_source": "none"})
    return out


def at_answer_position(runner: Any, records: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Chat records with the model's own prefix (one unsteered greedy pass of ``runner``);
    completion records unchanged (their answer starts right after the prompt)."""
    chat = [i for i, r in enumerate(records) if "messages" in r]
    if not chat:
        return [dict(r) for r in records]
    res = runner.run([records[i] for i in chat], [None], progress=False)
    done = with_prefixes([records[i] for i in chat], [x["text"] for x in res[0]])
    out = [dict(r) for r in records]
    for i, r in zip(chat, done, strict=True):
        out[i] = r
    return out


def answer_position_note(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Where log P(gold) was forced, for the record of a run: counts of each prefix source."""
    src = [r.get("prefix_source", "prompt end") for r in records]
    return {
        "rule": "chat: after the model's own unsteered reply up to the name (own), or as far "
        "as it echoes the question (echo), a reply of the same relation and "
        "language with the subject swapped (template), or none; "
        "completion: right after the prompt",
        "counts": {k: src.count(k) for k in dict.fromkeys(src)},
    }
