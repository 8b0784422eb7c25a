"""The answer position of chat replies: the model's own prefix, templates, and log P after it."""

from __future__ import annotations

import pytest

from steerserve.tune import prefixes as px
from steerserve.tune.facts import eval_records
from steerserve.tune.runner import Runner, encode

pytestmark = pytest.mark.usefixtures("one_thread")


def _ja(n: int = 3) -> list[dict]:
    return eval_records(
        "calib", langs=["ja"], limit_per_lang=n, form="chat", relations=["capital_of"]
    )


def test_prefix_is_the_reply_up_to_the_name() -> None:
    rec = _ja(1)[0]
    name, en = rec["answers"][0], rec["answers_en"][0]
    assert px.restated_prefix(rec, f"首都は{name}です。") == "首都は"
    assert px.restated_prefix(rec, f"首都は{en}です。") == "首都は"  # the English name counts
    assert px.restated_prefix(rec, "わかりません。首都は" + name) is None  # not in the 1st sentence


def test_a_reply_naming_no_answer_borrows_its_relations_template() -> None:
    recs = _ja(3)
    subj = [px._facts()[r["id"]].subject for r in recs]
    replies = [f"{subj[0]}の首都は{recs[0]['answers'][0]}です。", "わかりません。", "{}"]
    out = px.with_prefixes(recs, replies)
    assert [r["prefix_source"] for r in out] == ["own", "template", "template"]
    assert out[0]["reply_prefix"] == f"{subj[0]}の首都は"
    assert out[1]["reply_prefix"] == f"{subj[1]}の首都は"  # the subject swapped in
    none = px.with_prefixes(recs[1:], ["?", "?"])
    assert [r["reply_prefix"] for r in none] == ["", ""]
    note = px.answer_position_note(out)
    assert note["counts"] == {"own": 1, "template": 2}


def test_a_wrong_reply_that_echoes_the_question_keeps_its_own_words() -> None:
    """A wrong name is still where the name starts: the reply is cut where it stops echoing the
    question, if the echo passes the subject; a reordered reply borrows the template."""
    recs = _ja(2)
    q = recs[1]["messages"][-1]["content"]
    subj = px._facts()[recs[1]["id"]].subject
    stem = q[: q.index(subj) + len(subj) + 1]  # the subject and one more character
    assert px.echoed_prefix(recs[1], stem + "ニューヨーク") is not None
    replies = [f"{px._facts()[recs[0]['id']].subject}の首都は{recs[0]['answers'][0]}です。",
               stem + "ニューヨークです。"]  # fmt: skip
    out = px.with_prefixes(recs, replies)
    assert [r["prefix_source"] for r in out] == ["own", "echo"]
    assert out[1]["reply_prefix"] == px.echoed_prefix(recs[1], replies[1])
    assert replies[1].startswith(out[1]["reply_prefix"]) and subj in out[1]["reply_prefix"]
    assert px.echoed_prefix(recs[1], subj) is None  # the subject alone restates nothing
    assert px.echoed_prefix(recs[1], "ニューヨーク" + stem) is None  # reordered: no echo


def test_log_p_is_forced_after_the_prefix(runner: Runner) -> None:
    """The prefix becomes prompt; the gold's tokens follow it; without one nothing changes."""
    rec = _ja(1)[0]
    ids, aliases = encode(runner.tok, rec)
    pre = {**rec, "reply_prefix": "首都は"}
    ids2, aliases2 = encode(runner.tok, pre)
    tail = runner.tok("首都は", add_special_tokens=False)["input_ids"]
    assert ids2 == ids + tail
    whole = runner.tok("首都は" + rec["answers"][0], add_special_tokens=False)["input_ids"]
    assert aliases2[0] == whole[len(tail) :]
    assert encode(runner.tok, {**rec, "reply_prefix": ""}) == (ids, aliases)
    res = runner.run([rec, pre], [None], progress=False)
    assert res[0][0]["logp"] != res[0][1]["logp"]  # a different position, a different score
    with_own = px.at_answer_position(runner, [rec])
    assert with_own[0]["prefix_source"] in {"own", "template", "none"}


def test_a_space_ending_the_prefix_goes_with_the_name(runner: Runner) -> None:
    """ "La capital de Rusia es " is read as the model writes it: the prompt ends at "es" and
    the name's tokens carry the space, never a lone space token before the patched state."""
    rec = {**_ja(1)[0], "answers": ["Moscu"]}
    spaced, bare = (
        {**rec, "reply_prefix": "la capital es "},
        {**rec, "reply_prefix": "la capital es"},
    )
    ids, aliases = encode(runner.tok, spaced)
    assert ids == encode(runner.tok, bare)[0]
    core = runner.tok("la capital es", add_special_tokens=False)["input_ids"]
    whole = runner.tok("la capital es Moscu", add_special_tokens=False)["input_ids"]
    assert whole[: len(core)] == core and aliases == [whole[len(core) :]]
