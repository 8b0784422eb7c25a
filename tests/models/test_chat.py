"""The one chat rendering: the model's template when it has one, a plain transcript otherwise,
and the checks a chat must pass before a model sees it."""

from __future__ import annotations

from pathlib import Path

import pytest

from steerserve.models.chat import chat_ids, check_messages, reply_separator

CHAT = [
    {"role": "system", "content": "Answer with the name only."},
    {"role": "user", "content": "フランスの首都はどこですか？"},
]


@pytest.fixture(scope="module")
def tok(tiny_gemma: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_gemma)


def test_template_rendering_ends_where_the_reply_starts(tok) -> None:
    ids = chat_ids(tok, CHAT)
    text = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids).endswith("<assistant>") and ids.count(tok.bos_token_id) == 1
    assert reply_separator(tok) == ""


def test_plain_transcript_without_a_template(tok) -> None:
    template, tok.chat_template = tok.chat_template, None
    try:
        lone = chat_ids(tok, [{"role": "user", "content": "Capital: Rome\nCapital:"}])
        assert lone == tok.encode("Capital: Rome\nCapital:")  # a few-shot prompt passes as is
        turns = [*CHAT, {"role": "assistant", "content": "パリ"}, {"role": "user", "content": "?"}]
        text = (
            "Answer with the name only.\n\nUser: フランスの首都はどこですか？\nAssistant: パリ\n"
            "User: ?\nAssistant:"
        )
        assert chat_ids(tok, turns) == tok.encode(text)
        assert reply_separator(tok) == " "
    finally:
        tok.chat_template = template


def test_check_messages() -> None:
    dev = [{"role": "developer", "content": "x"}, {"role": "user", "content": "y"}]
    assert check_messages(dev)[0] == {"role": "system", "content": "x"}
    for bad, msg in [
        ([], "non-empty list"),
        ([{"role": "robot", "content": "x"}], r"messages\[0\].role 'robot' is unknown"),
        ([{"role": "user", "content": "  "}], r"messages\[0\].content is empty"),
        ([{"role": "user"}], "content is empty"),
        ([{"role": "system", "content": "x"}], "no user turn"),
        ([{"role": "user", "content": "x", "name": "n"}], "must be {role, content}"),
    ]:
        with pytest.raises(ValueError, match=msg):
            check_messages(bad)
