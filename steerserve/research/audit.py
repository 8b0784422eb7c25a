"""Checking the scorer against reading: a blind sample of kept replies, judged by people, and
the scorer's false positive and negative rates against those judgements.

``sample`` writes the replies to read without the scorer's verdict (so the reader is not led);
a reader adds ``"correct": true|false`` (the first sentence answers the question correctly, in
the query language) and ``"script": "query"|"latin"|"han"|"other"`` to each line; ``compare``
joins the judgements with the scorer's verdicts.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

from steerserve.research.facts import SPLITS, eval_records
from steerserve.research.replies import Reply, read_replies, rejudge
from steerserve.research.scorer import question_of


@cache
def chat_records() -> dict[str, dict]:
    """Every built-in fact's zero-shot chat record by id (the question a reply answered)."""
    return {r["id"]: r for s in SPLITS for r in eval_records(s, form="chat")}


def sample(
    replies: Sequence[Reply], per_lang: Mapping[str, int], seed: int = 0
) -> list[dict[str, Any]]:
    """``per_lang[lang]`` replies of each language, drawn with ``seed``, without verdicts."""
    rng = random.Random(seed)
    recs = chat_records()
    out: list[dict[str, Any]] = []
    for lang, n in per_lang.items():
        mine = [r for r in replies if r.lang == lang]
        for r in rng.sample(mine, min(n, len(mine))):
            rec = recs[r.id]
            out.append({
                "key": f"{r.arm}|{r.id}", "lang": lang, "question": question_of(rec),
                "accepted_answers": rec["answers"], "english_answers": rec["answers_en"],
                "chinese_answers": rec.get("answers_zh", []), "reply": r.text,
            })  # fmt: skip
    return out


def _rate(k: int, n: int) -> dict[str, Any]:
    return {"k": k, "n": n, "rate": k / n if n else None}


def compare(
    judged: Sequence[Mapping[str, Any]],
    replies: Sequence[Reply],
    records: Callable[[str], Mapping[str, Mapping[str, Any]]] | None = None,
) -> dict[str, Any]:
    """Agreement of today's scorer with the readers: false positives (scored correct, read
    wrong) among replies read wrong, false negatives among replies read correct, script
    agreement, and every disagreement with both verdicts, per language group and overall. Each
    kept reply is judged again by the current scorer (a fixed scorer re-audits old replies),
    against the record its arm asked (``records(arm)``; default the zero-shot chat records)."""
    zero = chat_records()
    asked = records or (lambda arm: zero)
    by_key = {f"{r.arm}|{r.id}": rejudge(asked(r.arm)[r.id], r) for r in replies}
    groups: dict[str, list[tuple[Mapping[str, Any], Reply]]] = {"all": []}
    for j in judged:
        r = by_key[j["key"]]
        groups["all"].append((j, r))
        groups.setdefault("ja/ko" if r.lang in ("ja", "ko") else "other", []).append((j, r))
    out: dict[str, Any] = {}
    for name, pairs in groups.items():
        read_ok = [(j, r) for j, r in pairs if j["correct"]]
        read_bad = [(j, r) for j, r in pairs if not j["correct"]]
        out[name] = {
            "n": len(pairs),
            "false_positive": _rate(
                sum(r.verdict == "correct" for _, r in read_bad), len(read_bad)
            ),
            "false_negative": _rate(sum(r.verdict != "correct" for _, r in read_ok), len(read_ok)),
            "script_agrees": _rate(sum(j["script"] == r.script for j, r in pairs), len(pairs)),
        }
    out["disagreements"] = [
        {"key": j["key"], "reply": r.text, "read": {"correct": j["correct"], "script": j["script"]},
         "scored": {"verdict": r.verdict, "script": r.script, "why": r.why},
         "note": j.get("note", "")}
        for j, r in groups["all"]
        if bool(j["correct"]) != (r.verdict == "correct") or j["script"] != r.script
    ]  # fmt: skip
    return out


def write_jsonl(path: str | Path, rows: Sequence[Mapping[str, Any]]) -> None:
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    Path(path).write_text(text, encoding="utf-8")


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [json.loads(x) for x in lines if x.strip()]


__all__ = ["chat_records", "compare", "read_jsonl", "read_replies", "sample", "write_jsonl"]
