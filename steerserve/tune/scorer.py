"""The one scorer of replies (``RULES`` states each rule): a completion's first line starts with
a folded gold answer, a chat's first sentence contains one; wrong ones are classed by pivot.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_PUNCT = re.compile(r"[\s\W_]+", re.UNICODE)
#: One katakana name, several spellings (ヴェネツィア/ベネチア, ウィーン/ウイーン): folded to one.
_KANA_FOLDS: tuple[tuple[str, str], ...] = (
    ("ヴァ", "バ"), ("ヴィ", "ビ"), ("ヴェ", "ベ"), ("ヴォ", "ボ"), ("ヴ", "ブ"),
    ("ウィ", "ウイ"), ("ウェ", "ウエ"), ("ウォ", "ウオ"), ("ツィ", "チ"), ("ー", ""),
)  # fmt: skip
#: A sentence ends at a CJK full stop, or at . ! ? followed by a space when the word before it
#: is not a one- or two-letter abbreviation ("St. Petersburg", "D. C.").
_SENTENCE_END = re.compile(r"[。！？]|(?<![\s.][A-Z])(?<![\s.][A-Z][a-z])[.!?](?=\s)")


def _casefold(text: str, lang: str | None) -> str:
    """NFKC, casefold, Latin letters without their accents (alemán = aleman: readers accept
    both), katakana spellings folded, zh traditional as simplified."""
    t = unicodedata.normalize("NFKC", text).casefold()
    t = "".join(_bare(c) if "LATIN" in unicodedata.name(c, "") else c for c in t)
    if any(_kana(c) for c in t):
        for a, b in _KANA_FOLDS:
            t = t.replace(a, b)
    if lang == "zh":
        from hanziconv import HanziConv

        t = HanziConv.toSimplified(t)
    return t


def _bare(c: str) -> str:
    return "".join(x for x in unicodedata.normalize("NFD", c) if unicodedata.category(x) != "Mn")


def fold(text: str, lang: str | None = None) -> str:
    """The form answers are compared in: NFKC, casefold, Latin accents and punctuation dropped,
    katakana spellings and (zh) traditional Han folded: ``fold("ヴァ") == fold("バ")``."""
    return _PUNCT.sub("", _casefold(text, lang))


def _words(text: str, lang: str | None = None) -> str:
    """:func:`fold` keeping word boundaries (punctuation and whitespace as one space)."""
    return " " + _PUNCT.sub(" ", _casefold(text, lang)).strip() + " "


def normalise(text: str) -> str:
    """:func:`fold` without a language: "  París." == "parís"."""
    return fold(text)


def first_line(text: str) -> str:
    """The answer is the first non-empty-prefix line: ``" Paris\\nCountry: ..."`` -> ``"Paris"``."""
    return text.lstrip(" \t").split("\n", 1)[0].strip()


def first_sentence(text: str) -> str:
    """A chat answer: the first sentence of the first line (a second sentence may name other
    places: "パリです。ほかにリヨンも…")."""
    line = first_line(text)
    m = _SENTENCE_END.search(line)
    return line[: m.end()] if m else line


def ends_sentence(line: str) -> bool:
    """Whether a sentence ends inside ``line`` (see :func:`first_sentence`)."""
    return _SENTENCE_END.search(line) is not None


def answer_span(text: str, chat: bool) -> str:
    """The part of a reply that is scored: first sentence of a chat reply, first line else."""
    return first_sentence(text) if chat else first_line(text)


def matches(pred: str, answers: Iterable[str], lang: str | None = None) -> bool:
    """True if the folded prediction starts with some folded (non-empty) answer."""
    p = fold(pred, lang)
    return any(a and p.startswith(a) for a in (fold(x, lang) for x in answers))


def contains(pred: str, answers: Iterable[str], lang: str | None = None) -> bool:
    """True if a folded answer occurs in the folded prediction: Latin ones as whole words ("somali"
    is not in "Somalie"), others anywhere (CJK and Arabic attach particles to the name)."""
    p, w = fold(pred, lang), _words(pred, lang)
    for x in answers:
        a = fold(x, lang)
        if a and a in p and (latin_share(x) < 1 or _words(x, lang) in w):
            return True
    return False


def _is_latin(ch: str) -> bool:
    return ch.isalpha() and unicodedata.name(ch, "").startswith("LATIN")


def latin_share(text: str) -> float:
    """Share of the letters of ``text`` that are Latin (0 when it has none)."""
    letters = [c for c in text if c.isalpha()]
    return sum(map(_is_latin, letters)) / len(letters) if letters else 0.0


def _han(c: str) -> bool:
    return "\u4e00" <= c <= "\u9fff" or "\u3400" <= c <= "\u4dbf" or "\uf900" <= c <= "\ufaff"


def _kana(c: str) -> bool:
    return "\u3040" <= c <= "\u30ff" or "\u31f0" <= c <= "\u31ff" or "\uff66" <= c <= "\uff9f"


def _hangul(c: str) -> bool:
    return "\uac00" <= c <= "\ud7a3" or "\u1100" <= c <= "\u11ff" or "\u3130" <= c <= "\u318f"


def looks_chinese(text: str) -> bool:
    """Han characters and neither kana nor Hangul: Chinese rather than Japanese or Korean."""
    return any(map(_han, text)) and not any(_kana(c) or _hangul(c) for c in text)


RULES: dict[str, str] = {
    "correct.completion": "first line, folded (NFKC, casefold, accents of Latin letters, "
    "katakana spellings, Chinese traditional as simplified, no punctuation or whitespace), "
    "starts with a folded accepted answer",
    "correct.chat": "first sentence of the first line, folded, contains a folded accepted answer "
    "(one in Latin letters as whole words)",
    "english.completion": "wrong, and starts with an English answer (answers_en)",
    "english.chat": "wrong, and contains an English answer (other than one the question itself "
    "gave, when the reply says more), or, when the query language's answers are not in Latin "
    "script, the letters the reply adds to the question are mostly Latin",
    "chinese": "query language not zh, wrong, and contains the Chinese answer (answers_zh), or "
    "has Han characters and no kana or Hangul, or (ko) adds Han characters and no kana to the "
    "question",
    "script": "the script the answer is written in: latin (the English rule), han (the Chinese "
    "rule), other (wrong, and most letters the reply adds are in a script that is neither the "
    "query language's, Latin nor Han: kana in a Korean reply, Cyrillic in a Japanese one), else "
    'query; a parenthesised gloss ("インドポンド（INR）") is left out when letters stand outside it',
}


@dataclass(frozen=True)
class Score:
    correct: bool
    english: bool  # answered in English (the English name) instead of the query language
    recall_any: bool  # correct in the query language or in English
    chinese: bool = False  # answered in Chinese instead of the query language
    other: bool = False  # wrong, and in another language's script (kana in a Korean reply)

    @property
    def script(self) -> str:
        """``query``, ``latin``, ``han`` or ``other``: the script the answer is written in."""
        if self.english:
            return "latin"
        return "han" if self.chinese else "other" if self.other else "query"


def score(
    continuation: str,
    answers: Sequence[str],
    answers_en: Sequence[str] = (),
    *,
    chat: bool = False,
    lang: str | None = None,
    answers_zh: Sequence[str] = (),
    question: str = "",
) -> Score:
    """Score one reply (see the module docstring); ``chat`` selects the chat rules, whose
    ``question`` (the last user turn) tells which letters the reply added."""
    pred = answer_span(continuation, chat)
    hit = contains if chat else matches
    ok = hit(pred, answers, lang)
    in_en = hit(_without_echo(pred, answers_en, question), answers_en)
    added = _added_letters(pred, question)
    en = not ok and (in_en or (chat and _latin_reply(added, answers)))
    kana = any(map(_kana, added))
    zh = (
        not ok
        and lang != "zh"
        and (
            hit(pred, answers_zh, "zh")
            or looks_chinese(pred)
            or (chat and lang == "ko" and any(map(_han, added)) and not kana)
        )
    )
    other = chat and not (ok or en or zh) and _foreign(added, lang)
    return Score(ok, bool(en), ok or in_en, bool(zh), bool(other))


_GLOSS = re.compile(r"[(（][^)）]*[)）]")


def _without_echo(pred: str, answers_en: Sequence[str], question: str) -> str:
    """``pred`` without English answers the question itself gave ("「Chinese Yuan」は「円」です":
    円), unless nothing else is left."""
    echoes = [a for a in answers_en if a and question and fold(a) in fold(question)]
    rest = pred
    for a in sorted(echoes, key=len, reverse=True):
        rest = re.sub(re.escape(a), " ", rest, flags=re.IGNORECASE)
    return rest if echoes and _added_letters(rest, question) else pred


def _added_letters(pred: str, question: str) -> str:
    """The letters a reply adds to the question, leaving out a parenthesised gloss when
    something is outside it ("インドポンド（INR）": the answer is the katakana, not INR)."""
    bare = _GLOSS.sub("", pred)
    span = bare if any(c.isalpha() for c in bare) else pred
    return "".join(c for c in span if c.isalpha() and c not in question)


#: Each query language's own scripts (unicodedata name prefixes); Latin and Han are classed
#: apart (the English and Chinese rules).
_OWN_SCRIPTS: dict[str, tuple[str, ...]] = {
    "ja": ("HIRAGANA", "KATAKANA", "CJK"), "ko": ("HANGUL",), "ru": ("CYRILLIC",),
    "ar": ("ARABIC",), "zh": ("CJK",),
}  # fmt: skip


def _foreign(added: str, lang: str | None) -> bool:
    """Most added letters are in a script that is neither the query language's own, nor Latin,
    nor Han (Japanese kana in a Korean reply, Cyrillic in a Japanese one)."""
    own = _OWN_SCRIPTS.get(lang or "", ("LATIN",))
    letters = [unicodedata.name(c, "") for c in added]
    if not letters:
        return False
    alien = [n for n in letters if not n.startswith((*own, "LATIN", "CJK"))]
    return len(alien) / len(letters) > 0.5


def _latin_reply(added: str, answers: Sequence[str]) -> bool:
    """Mostly Latin letters added to a question whose answers are not Latin script."""
    return latin_share(added) > 0.5 and not any(latin_share(a) > 0.5 for a in answers)


def question_of(rec: Mapping[str, Any]) -> str:
    """The last user turn of a chat record (empty for a completion)."""
    users = [m["content"] for m in rec.get("messages", ()) if m.get("role") == "user"]
    return users[-1] if users else ""


def score_record(rec: Mapping[str, Any], text: str) -> Score:
    """:func:`score` with the record's form, language, answers and question."""
    return score(
        text,
        rec["answers"],
        rec.get("answers_en", ()),
        chat="messages" in rec,
        lang=rec.get("lang"),
        answers_zh=rec.get("answers_zh", ()),
        question=question_of(rec),
    )


def rules(chat: bool) -> dict[str, str]:
    """The rules a report on records of this form was scored by."""
    form = "chat" if chat else "completion"
    return {
        "correct": RULES[f"correct.{form}"],
        "english": RULES[f"english.{form}"],
        "chinese": RULES["chinese"],
        "script": RULES["script"],
    }
