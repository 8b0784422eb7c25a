"""The fact set: a reproducible build, splits by fact, well-formed prompts and shots."""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest

from steerserve.tune import facts
from steerserve.tune.facts import (
    LANGS,
    PAPER_LANGS,
    RELATIONS,
    Fact,
    build,
    eval_records,
    load_facts,
    prompt,
    query,
    shots_for,
)
from steerserve.tune.facts import chat as fchat


def test_build_is_deterministic_and_committed() -> None:
    text = build.render(build.build_records())
    assert text == build.render(build.build_records())
    assert text == facts.DATA.read_text(encoding="utf-8"), (
        "run python -m steerserve.tune.facts.build"
    )


def test_coverage() -> None:
    all_facts = load_facts()
    assert len(RELATIONS) >= 4 and len(LANGS) >= 10
    assert set(PAPER_LANGS) <= set(LANGS)
    assert {f.relation for f in all_facts} == set(RELATIONS)
    langs_of = defaultdict(set)
    for f in all_facts:
        langs_of[f.fact_id].add(f.lang)
    assert all(ls == set(LANGS) for ls in langs_of.values()), "every fact in every language"
    per_rel = Counter(f.relation for f in all_facts if f.lang == "en")
    assert all(per_rel[r] >= 40 for r in RELATIONS), per_rel
    assert 300 <= len(langs_of) <= 1000


def test_splits_are_by_fact_and_proportional() -> None:
    split_of: dict[str, set[str]] = defaultdict(set)
    for f in load_facts():
        split_of[f.fact_id].add(f.split)
    assert all(len(s) == 1 for s in split_of.values()), "a fact's translations share one split"
    for rel in RELATIONS:
        n = Counter(f.split for f in load_facts(relations=[rel], langs=["en"]))
        total = sum(n.values())
        assert abs(n["train"] / total - 0.5) < 0.03
        assert abs(n["calib"] / total - 0.2) < 0.03
        assert abs(n["test"] / total - 0.3) < 0.03


def test_records_are_well_formed() -> None:
    en_answers = {}
    for f in load_facts():
        assert f.subject.strip() == f.subject and f.subject
        assert f.answers and all(a.strip() for a in f.answers)
        assert f.answers_en and all(a.strip() for a in f.answers_en)
        assert len(set(a.casefold() for a in f.answers)) == len(f.answers), f
        assert en_answers.setdefault(f.fact_id, f.answers_en) == f.answers_en
        assert "\n" not in f.subject + "".join(f.answers)


@pytest.mark.parametrize(
    ("fact_id", "lang", "subject", "answer"),
    [
        ("capital_of:FR", "fr", "France", "Paris"),
        ("capital_of:FR", "ja", "フランス", "パリ"),
        ("capital_of:JP", "zh", "日本", "东京"),
        ("capital_of:KR", "ko", "대한민국", "서울"),
        ("capital_of:DE", "es", "Alemania", "Berlín"),
        ("city_in:US-New_York", "en", "New York", "United States"),
        ("language_of:BR", "ru", "Бразилия", "португальский"),
        ("currency_of:JP", "en", "Japan", "Japanese Yen"),
    ],
)
def test_known_facts(fact_id: str, lang: str, subject: str, answer: str) -> None:
    (f,) = [f for f in load_facts(langs=[lang]) if f.fact_id == fact_id]
    assert f.subject == subject and f.answers[0] == answer


def test_aliases_do_not_accept_the_english_form() -> None:
    """es París must not also accept Paris: that is the conversion failure we measure."""
    (es,) = [f for f in load_facts(langs=["es"]) if f.fact_id == "capital_of:FR"]
    assert "Paris" not in es.answers
    (en,) = [f for f in load_facts(langs=["en"]) if f.fact_id == "currency_of:JP"]
    assert "Yen" in en.answers  # the short form is an alias


def test_load_facts_filters_and_refuses_unknown_names() -> None:
    got = load_facts("calib", ["ja", "ko"], ["city_in"])
    assert got and {(f.split, f.relation) for f in got} == {("calib", "city_in")}
    assert {f.lang for f in got} == {"ja", "ko"}
    with pytest.raises(ValueError, match="unknown split"):
        load_facts("dev")
    with pytest.raises(ValueError, match="unknown language"):
        load_facts(langs=["xx"])


def test_query_and_prompt_shape() -> None:
    for f in load_facts("test"):
        q = query(f)
        assert f.subject in q and q == q.rstrip()
        assert q.endswith("：" if f.lang in ("zh", "ja") else ":")
        p = prompt(f, shots=3)
        assert p.endswith("\n" + q) and p.count("\n") == 3
        for line in p.splitlines()[:-1]:
            assert line.startswith(q.split(f.subject)[0])  # same template
        assert prompt(f, shots=0) == q


def test_shots_come_from_train_and_never_the_query() -> None:
    for f in load_facts():
        shots = shots_for(f, 3, seed=1)
        assert len(shots) == 3
        for s in shots:
            assert s.split == "train" and s.fact_id != f.fact_id
            assert (s.lang, s.relation) == (f.lang, f.relation)
        answers = [s.answers_en[0] for s in shots]
        assert f.answers_en[0] not in answers and len(set(answers)) == 3


def test_shots_are_deterministic_and_shared_across_translations() -> None:
    f_en, f_ja = (
        next(f for f in load_facts("test", [lang]) if f.fact_id == "capital_of:IT")
        for lang in ("en", "ja")
    )
    ids = [s.fact_id for s in shots_for(f_en, 5, seed=3)]
    assert ids == [s.fact_id for s in shots_for(f_en, 5, seed=3)]
    assert ids == [s.fact_id for s in shots_for(f_ja, 5, seed=3)]
    others = {tuple(s.fact_id for s in shots_for(f_en, 5, seed=k)) for k in range(5)}
    assert len(others) > 1, "the seed changes the shots"


def test_eval_records_schema_and_limit() -> None:
    recs = eval_records(limit_per_lang=8, langs=["en", "fr"])
    assert [r["lang"] for r in recs] == ["en"] * 8 + ["fr"] * 8
    assert {r["id"].split(":")[0] for r in recs} == set(RELATIONS), "relations interleaved"
    for r in recs:
        assert set(r) == {"id", "lang", "prompt", "answers", "answers_en"}
        assert r["id"].endswith(":" + r["lang"]) and r["answers"]
    full = eval_records()
    assert len(full) == len(load_facts("test"))
    assert len({r["id"] for r in full}) == len(full)

    # Two halves: disjoint, together everything, each with every relation, alike in familiarity.
    all_en = [r["id"] for r in eval_records("calib", langs=["en"])]
    even = [r["id"] for r in eval_records("calib", langs=["en"], part=(0, 2))]
    odd = [r["id"] for r in eval_records("calib", langs=["en"], part=(1, 2))]
    assert not set(even) & set(odd) and set(even) | set(odd) == set(all_en)
    for rel in RELATIONS:
        of = [i for i in all_en if i.startswith(rel + ":")]
        assert [i for i in even if i.startswith(rel + ":")] == of[0::2]
        assert [i for i in odd if i.startswith(rel + ":")] == of[1::2]
    assert (
        {i.split(":")[0] for i in even[:8]} == {i.split(":")[0] for i in odd[:8]} == set(RELATIONS)
    )


def test_fact_is_frozen() -> None:
    f = load_facts()[0]
    assert isinstance(f, Fact)
    with pytest.raises(AttributeError):
        f.subject = "x"  # type: ignore[misc]


# --- the chat form ---------------------------------------------------------------------------


def test_chat_questions_cover_every_relation_and_language() -> None:
    for rel in RELATIONS:
        assert set(fchat.QUESTIONS[rel]) == set(LANGS), rel
    assert set(fchat.INSTRUCTION) == set(LANGS)
    for f in load_facts():
        q = fchat.question(f)
        assert f.subject in q and "{" not in q and q == q.strip()
        assert q[-1] in "?？؟", q  # a question, as a user types it


@pytest.mark.parametrize(
    ("fact_id", "lang", "question"),
    [
        ("capital_of:FR", "ja", "フランスの首都はどこですか？"),
        ("capital_of:FR", "en", "What is the capital of France?"),
        ("capital_of:FR", "zh", "法国的首都是哪里？"),
        ("capital_of:DE", "es", "¿Cuál es la capital de Alemania?"),
        ("capital_of:FR", "fr", "France : quelle est la capitale de ce pays ?"),
        ("language_of:BR", "ru", "Какой официальный язык в стране Бразилия?"),
        ("city_in:US-New_York", "ko", "뉴욕은 어느 나라에 있나요?"),  # 뉴욕 ends in a consonant
        ("city_in:US-Chicago", "ko", "시카고는 어느 나라에 있나요?"),  # 시카고 does not
    ],
)
def test_chat_questions_read_natively(fact_id: str, lang: str, question: str) -> None:
    (f,) = [f for f in load_facts(langs=[lang]) if f.fact_id == fact_id]
    assert fchat.question(f) == question


def test_chat_records_have_the_same_facts_and_splits_as_completion_records() -> None:
    for split in ("calib", "test"):
        for part in ((0, 1), (1, 2)):
            comp = eval_records(split, part=part, limit_per_lang=20)
            chat = eval_records(split, part=part, limit_per_lang=20, form="chat")
            assert [r["id"] for r in chat] == [r["id"] for r in comp]
            for c, r in zip(chat, comp, strict=True):
                assert c["answers"] == r["answers"] and c["answers_en"] == r["answers_en"]
    zh = {r["id"].rsplit(":", 1)[0]: r["answers"] for r in eval_records(langs=["zh"])}
    for r in eval_records(langs=["ja", "en"], form="chat"):
        assert set(r) == {"id", "lang", "messages", "answers", "answers_en", "answers_zh"}
        assert r["answers_zh"] == zh[r["id"].rsplit(":", 1)[0]]
        system, user = r["messages"]  # zero-shot: the instruction and the question
        assert system == {"role": "system", "content": fchat.INSTRUCTION[r["lang"]]}
        assert user["role"] == "user" and user["content"].endswith(("?", "？"))
    with pytest.raises(ValueError, match="unknown form"):
        eval_records(form="prompt")


def test_chat_demonstrations_are_earlier_turns() -> None:
    (f,) = [f for f in load_facts("test", ["ja"]) if f.fact_id == "capital_of:IT"]
    msgs = fchat.messages(f, shots=3, seed=0)
    assert [m["role"] for m in msgs] == ["system"] + ["user", "assistant"] * 3 + ["user"]
    pairs = zip(msgs[1:-1:2], msgs[2:-1:2], strict=True)
    for s, (q, a) in zip(shots_for(f, 3, 0), pairs, strict=True):
        assert q["content"] == fchat.question(s) and a["content"] == s.answers[0]
    assert msgs[-1]["content"] == fchat.question(f)
    assert fchat.messages(f) == [msgs[0], msgs[-1]]
