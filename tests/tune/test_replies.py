"""Replies kept whole: cut detection, the budget check, replies.jsonl, the reasons given."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from steerserve.tune import replies as rp

JA = {
    "id": "capital_of:RU:ja",
    "lang": "ja",
    "messages": [{"role": "user", "content": "ロシアの首都はどこですか？"}],
    "answers": ["モスクワ"],
    "answers_en": ["Moscow"],
    "answers_zh": ["莫斯科"],
}


def test_a_reply_is_cut_only_when_the_budget_ended_its_answer() -> None:
    cut = rp.Generation("ロシアの首都はモス", tokens=8, hit_budget=True)
    assert rp.is_cut(cut, chat=True)
    ended = rp.Generation("ロシアの首都はモスクワです。それから", tokens=64, hit_budget=True)
    assert not rp.is_cut(ended, chat=True)  # the scored sentence ended before the budget
    eos = rp.Generation("ロシアの首都はモスクワ", tokens=9, hit_budget=False)
    assert not rp.is_cut(eos, chat=True)  # EOS, not the budget
    assert rp.is_cut(rp.Generation(" Par", 8, True), chat=False)
    assert rp.budget("chat") == 64 and rp.budget("completion") == 8 and rp.budget("chat", 5) == 5
    assert rp.stop_strings("chat") == ["\n\n"] and rp.stop_strings("completion") == ["\n"]


def test_check_cuts_names_the_budget() -> None:
    rp.check_cuts([False] * 98 + [True] * 2, 64)  # 2 % is allowed
    with pytest.raises(rp.BudgetError, match=r"3 of 100 replies \(3.0%\).*64-token budget"):
        rp.check_cuts([False] * 97 + [True] * 3, 64)


def test_judge_keeps_the_reason_and_round_trips(tmp_path: Path) -> None:
    ok = rp.judge(JA, "unsteered", rp.Generation("ロシアの首都はモスクワです。", 9))
    assert (ok.verdict, ok.script, ok.cut) == ("correct", "query", False)
    assert ok.why == "contains the accepted answer 'モスクワ'"
    en = rp.judge(JA, "both", rp.Generation("ロシアの首都はMoscowです。", 9))
    assert (en.verdict, en.script) == ("wrong", "latin")
    assert en.why == "contains the English answer 'Moscow'"
    cut = rp.judge(JA, "both", rp.Generation("ロシアの首都は", 4, hit_budget=True))
    assert cut.cut and cut.why.endswith("cut by the budget after 4 tokens")
    path = rp.write_replies(tmp_path / "r" / "replies.jsonl", [ok, en, cut])
    lines = path.read_text(encoding="utf-8").splitlines()
    assert [rp.Reply(**json.loads(line)) for line in lines] == [ok, en, cut]


def test_a_loop_stopped_by_the_budget_is_not_a_cut() -> None:
    loop = "라이베리아의 통화는 리베리아" + "리아" * 30
    g = rp.Generation(loop, tokens=64, hit_budget=True)
    assert rp.loops(loop) and rp.is_loop(g, chat=True) and not rp.is_cut(g, chat=True)
    # a longer unit, stopped inside its third repetition
    unit = "ユーラ（ユーラ）とユーラ（ユーラ）の混合で、"
    assert rp.loops("キルギスは" + unit * 2 + unit[:17])
    assert not rp.loops("ロシアの首都はモスクワで、人口は千二百万人を超える大都市です")
    assert not rp.loops("ababababab")  # too short to call
    r = rp.judge(JA, "both", g)
    assert r.loop and not r.cut and "repeating itself" in r.why
