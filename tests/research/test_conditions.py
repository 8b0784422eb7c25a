"""The prompt conditions: each keeps its record's form and answers."""

from __future__ import annotations

from steerserve.research.conditions import condition_records, conditions, fact_index
from steerserve.research.facts import eval_records


def test_conditions_keep_the_form_and_the_answers() -> None:
    facts = fact_index("calib")
    for form in ("completion", "chat"):
        items = eval_records("calib", langs=["ja"], limit_per_lang=1, form=form)
        for cond in conditions(form):
            (rec,) = condition_records(items, facts, cond)
            assert ("messages" in rec) == (form == "chat") != ("prompt" in rec)
            assert rec["answers"] == items[0]["answers"]
    assert "zero" not in conditions("chat")  # the chat's evaluation form is zero-shot
    chat = eval_records("calib", langs=["ja"], limit_per_lang=1, form="chat")
    (mixed,) = condition_records(chat, facts, "mixed5")
    assert len(mixed["messages"]) == 12 and mixed["messages"][-1] == chat[0]["messages"][-1]
    assert mixed["messages"][1]["content"].isascii()  # English demonstrations
