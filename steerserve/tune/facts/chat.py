"""The fact set's chat form: one zero-shot question per relation and language after a native
system instruction (one cached prefix per language, no template's English default prompt).
"""

from __future__ import annotations

from steerserve.tune.facts.dataset import Fact, shots_for

#: "Answer with the name only", in each language of the fact set.
INSTRUCTION: dict[str, str] = {
    "en": "Answer with the name only.", "zh": "只回答名称。", "ja": "名前だけで答えてください。",
    "ko": "이름만 답하세요.", "fr": "Répondez uniquement par le nom.",
    "es": "Responde solo con el nombre.", "de": "Antworte nur mit dem Namen.",
    "it": "Rispondi solo con il nome.", "ru": "Ответь только названием.",
    "pt": "Responda apenas com o nome.", "nl": "Antwoord alleen met de naam.",
    "ar": "أجب بالاسم فقط.",
}  # fmt: skip

#: Zero-shot questions; ``{s}`` is the subject, ``{s_topic}`` a Korean subject with its topic
#: particle (은 after a final consonant, else 는).
QUESTIONS: dict[str, dict[str, str]] = {
    "capital_of": {
        "en": "What is the capital of {s}?", "zh": "{s}的首都是哪里？",
        "ja": "{s}の首都はどこですか？", "ko": "{s}의 수도는 어디인가요?",
        "fr": "{s} : quelle est la capitale de ce pays ?", "es": "¿Cuál es la capital de {s}?",
        "de": "Was ist die Hauptstadt von {s}?",
        "it": "{s}: qual è la capitale di questo paese?",
        "ru": "Какой город является столицей страны {s}?", "pt": "Qual é a capital de {s}?",
        "nl": "Wat is de hoofdstad van {s}?", "ar": "ما هي عاصمة {s}؟",
    },
    "city_in": {
        "en": "Which country is {s} in?", "zh": "{s}位于哪个国家？",
        "ja": "{s}はどこの国にありますか？", "ko": "{s_topic} 어느 나라에 있나요?",
        "fr": "Dans quel pays se trouve {s} ?", "es": "¿En qué país está {s}?",
        "de": "In welchem Land liegt {s}?", "it": "In quale paese si trova {s}?",
        "ru": "В какой стране находится {s}?", "pt": "Em que país fica {s}?",
        "nl": "In welk land ligt {s}?", "ar": "في أي دولة تقع {s}؟",
    },
    "language_of": {
        "en": "What is the official language of {s}?", "zh": "{s}的官方语言是什么？",
        "ja": "{s}の公用語は何ですか？", "ko": "{s}의 공용어는 무엇인가요?",
        "fr": "{s} : quelle est la langue officielle de ce pays ?",
        "es": "¿Cuál es el idioma oficial de {s}?", "de": "Was ist die Amtssprache von {s}?",
        "it": "{s}: qual è la lingua ufficiale di questo paese?",
        "ru": "Какой официальный язык в стране {s}?", "pt": "Qual é a língua oficial de {s}?",
        "nl": "Wat is de officiële taal van {s}?", "ar": "ما هي اللغة الرسمية في {s}؟",
    },
    "currency_of": {
        "en": "What is the currency of {s}?", "zh": "{s}使用什么货币？",
        "ja": "{s}の通貨は何ですか？", "ko": "{s}의 통화는 무엇인가요?",
        "fr": "{s} : quelle est la monnaie de ce pays ?", "es": "¿Cuál es la moneda de {s}?",
        "de": "Was ist die Währung von {s}?", "it": "{s}: qual è la valuta di questo paese?",
        "ru": "Какая валюта в стране {s}?", "pt": "Qual é a moeda de {s}?",
        "nl": "Wat is de munteenheid van {s}?", "ar": "ما هي عملة {s}؟",
    },
}  # fmt: skip


def _korean_topic(word: str) -> str:
    """``word`` + 은/는, chosen by whether its last syllable ends in a consonant."""
    last = word[-1:]
    if "가" <= last <= "힣":
        return word + ("은" if (ord(last) - ord("가")) % 28 else "는")
    return word + "은(는)"


def question(fact: Fact) -> str:
    """The zero-shot question of ``fact`` in ``fact.lang``."""
    s = fact.subject
    return QUESTIONS[fact.relation][fact.lang].format(s=s, s_topic=_korean_topic(s))


def messages(
    fact: Fact, shots: int = 0, seed: int = 0, demos_from: dict[str, Fact] | None = None
) -> list[dict[str, str]]:
    """The chat of ``fact``: the instruction, ``shots`` demonstrations as earlier turns, then the
    question; ``demos_from`` swaps a demonstration for another fact (its English twin: "mixed")."""
    out = [{"role": "system", "content": INSTRUCTION[fact.lang]}]
    for s in shots_for(fact, shots, seed) if shots else []:
        s = (demos_from or {}).get(s.fact_id, s)
        out += [
            {"role": "user", "content": question(s)},
            {"role": "assistant", "content": s.answers[0]},
        ]
    return out + [{"role": "user", "content": question(fact)}]
