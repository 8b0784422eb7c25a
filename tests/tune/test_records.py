"""Evaluation records of both forms: reading, checks naming the record, rendering, form."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from steerserve.models.chat import chat_ids
from steerserve.tune import records as rd
from steerserve.tune.facts import eval_records

Q = [{"role": "user", "content": "¿Cuál es la capital de Francia?"}]


def _write(tmp_path: Path, *recs: dict) -> Path:
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs) + "\n")
    return p


def test_reads_both_forms(tmp_path: Path) -> None:
    chat = {"id": "c1", "lang": "es", "messages": Q, "answers": ["París"], "answers_en": ["Paris"]}
    comp = {"id": "p1", "lang": "fr", "prompt": "Capitale :", "answers": ["Paris"]}
    [c] = rd.read_dataset(_write(tmp_path, chat))
    assert c["messages"] == Q and rd.form_of(c) == "chat" and rd.dataset_form([c]) == "chat"
    [p] = rd.read_dataset(_write(tmp_path, comp))
    assert p["answers_en"] == [] and rd.dataset_form([p]) == "completion"
    with pytest.raises(ValueError, match="mix"):
        rd.dataset_form([c, p])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"messages": [{"role": "narrator", "content": "x"}]}, "role 'narrator' is unknown"),
        ({"messages": [{"role": "system", "content": "x"}]}, "no user turn"),
        ({"messages": [{"role": "user", "content": ""}]}, "content is empty"),
        ({"messages": []}, "non-empty list"),
        ({"prompt": "x"}, "both prompt and messages"),
        ({"answers": []}, "answers must be a non-empty list"),
        ({"messages": None, "prompt": None}, "missing"),
    ],
)
def test_bad_chat_records_name_their_id(tmp_path: Path, change: dict, message: str) -> None:
    rec = {"id": "capital_of:FR:es", "lang": "es", "messages": Q, "answers": ["París"]}
    rec.update(change)
    rec = {k: v for k, v in rec.items() if v is not None}
    ok = {"id": "ok", "lang": "es", "messages": Q, "answers": ["París"]}
    with pytest.raises(ValueError, match=message) as e:
        rd.read_dataset(_write(tmp_path, ok, rec))
    assert "d.jsonl:2: record 'capital_of:FR:es'" in str(e.value)


def test_encode_and_engine_prompts(tiny_gemma: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_gemma)
    recs = eval_records(langs=["ja"], limit_per_lang=2, form="chat")
    recs += eval_records(langs=["ja"], limit_per_lang=1)
    got = rd.engine_prompts(tok, recs)
    assert got[0] == chat_ids(tok, recs[0]["messages"]) == rd.encode(tok, recs[0]["messages"])
    assert got[2] == recs[2]["prompt"]  # completion text goes to the engine as text
    assert rd.encode(tok, recs[2]["prompt"])[0] == tok.bos_token_id


def test_default_form() -> None:
    assert rd.default_form("/m/qwen2.5-coder-1.5b-instruct") == "chat"
    assert rd.default_form("/m/gemma-3-1b-it") == "chat"
    assert rd.default_form("/m/gemma-3-270m") == "completion"
    assert rd.default_form("/m/Llama-3.2-3B") == "completion"
    assert rd.default_form("/m/gemma-3-270m", "chat") == "chat"
    with pytest.raises(ValueError, match="unknown form"):
        rd.default_form("/m/x", "text")


def test_answer_sep_by_record_then_language() -> None:
    """The record's ``sep`` wins; a prompt ending in a space needs none; else the fact set's."""
    assert rd.answer_sep({"lang": "ja", "prompt": "首都："}) == ""
    assert rd.answer_sep({"lang": "fr", "prompt": "Capitale :"}) == " "
    assert rd.answer_sep({"lang": "xx", "prompt": "Q: ", "sep": "\t"}) == "\t"
    assert rd.answer_sep({"lang": "fr", "prompt": "Capitale : "}) == ""
