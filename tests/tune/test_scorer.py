"""The scorer on hand-made cases: folding, first line and sentence, the chat rule, the script
an answer is written in, and a record whose answer folds to empty."""

from __future__ import annotations

import pytest

from steerserve.tune import scorer as ev


def test_normalise_and_match() -> None:
    assert ev.normalise("  París.") == "paris"  # a missing accent is not a wrong answer
    assert ev.normalise("ＰＡＲＩＳ") == "paris"  # NFKC full-width
    assert ev.normalise("Buenos-Aires!") == "buenosaires"
    assert ev.matches("Paris, France", ["Paris"])
    assert not ev.matches("Pa", ["Paris"])  # a prefix of the answer is not the answer
    assert not ev.matches("", ["Paris"])
    assert not ev.matches("Paris", [""])  # an empty gold answer matches nothing
    assert ev.matches("東京です", ["東京"])


def test_first_line() -> None:
    assert ev.first_line(" Paris\nCountry: Spain. Capital: Madrid") == "Paris"
    assert ev.first_line("\nParis") == ""  # an empty first line is a wrong answer
    assert ev.first_line("パリ") == "パリ"


def test_score_english_rate() -> None:
    s = ev.score(" London\n", ["Londres"], ["London"])
    assert (s.correct, s.english, s.recall_any) == (False, True, True)
    s = ev.score(" Londres", ["Londres"], ["London"])
    assert (s.correct, s.english) == (True, False)  # correct never also counts as English
    s = ev.score(" Rome", ["Londres"], ["London"])
    assert (s.correct, s.english, s.recall_any) == (False, False, False)
    s = ev.score(" Madrid", ["Madrid"], ["Madrid"])  # same name in both: correct, not English
    assert (s.correct, s.english) == (True, False)


def test_chat_rule_is_containment_in_the_first_line() -> None:
    s = ev.score("La capital de Francia es París.", ["París"], ["Paris"], chat=True, lang="es")
    assert (s.correct, s.english, s.chinese) == (True, False, False)
    s = ev.score("**París**", ["París"], ["Paris"], chat=True, lang="es")
    assert s.correct  # markup is punctuation
    s = ev.score("Madrid\nParís", ["París"], ["Paris"], chat=True, lang="es")
    assert not s.correct  # only the first line is the answer
    s = ev.score("La capitale est London.", ["Londres"], ["London"], chat=True, lang="es")
    assert (s.correct, s.english, s.recall_any) == (False, True, True)
    # the completion rule stays a prefix match
    s = ev.score(" La capital es París", ["París"], ["Paris"], lang="es")
    assert not s.correct


def test_reply_language_english_and_chinese() -> None:
    chat = {"chat": True}
    # non-Latin query language: a Latin reply is English even without the English gold name
    s = ev.score("Lima, Peru", ["リマ"], ["Lima"], lang="ja", **chat)
    assert (s.english, s.chinese) == (True, False)
    assert ev.score("Limassol", ["リマソル"], ["Limassol"], lang="ja", **chat).english
    assert ev.score("Bogota", ["Богота"], [], lang="ru", **chat).english
    # Latin query language: only the English gold name says English
    assert not ev.score("Lisboa", ["Lisbonne"], ["Lisbon"], lang="fr", **chat).english
    # Chinese: the fact's Chinese answer, or Han without kana/Hangul
    s = ev.score("利马", ["リマ"], ["Lima"], lang="ja", answers_zh=["利马"], **chat)
    assert (s.correct, s.chinese, s.english) == (False, True, False)
    assert ev.score("北京", ["ペキン"], ["Beijing"], lang="ja", **chat).chinese
    assert not ev.score("ペキンです", ["ペキン"], ["Beijing"], lang="ja", **chat).chinese
    assert not ev.score("東京です", ["パリ"], ["Paris"], lang="ja", **chat).chinese  # kana
    assert not ev.score("東京", ["東京"], ["Tokyo"], lang="ja", **chat).chinese  # correct
    assert ev.score("首尔", ["서울"], ["Seoul"], lang="ko", **chat).chinese
    assert not ev.score("서울특별시", ["파리"], ["Paris"], lang="ko", **chat).chinese
    assert not ev.score("上海", ["北京"], ["Beijing"], lang="zh", **chat).chinese  # zh query
    assert ev.latin_share("Paris パリ") == pytest.approx(5 / 7)
    assert ev.looks_chinese("巴黎") and not ev.looks_chinese("パリ市")


def test_fold_joins_spellings_of_one_name() -> None:
    assert ev.fold("ヴェネツィア") == ev.fold("ベネチア")  # ヴェ/ベ, ツィ/チ
    assert ev.fold("ウィーン") == ev.fold("ウイーン")  # ウィ/ウイ, long vowel mark dropped
    assert ev.fold("ジョン・スミス") == ev.fold("ジョンスミス")  # middle dot is punctuation
    assert ev.fold("臺北", "zh") == ev.fold("台北", "zh")  # traditional as simplified, for zh
    assert ev.fold("臺北", "ja") != ev.fold("台北", "ja")  # never for Japanese kanji
    assert ev.contains("首都是臺北。", ["台北"], "zh")


def test_chat_answer_is_the_first_sentence() -> None:
    assert ev.first_sentence("パリです。ほかにリヨンも大きい。") == "パリです。"
    assert ev.first_sentence("It is St. Petersburg. Not Moscow.") == "It is St. Petersburg."
    assert ev.first_sentence("Washington, D.C. is the capital. Yes.") == (
        "Washington, D.C. is the capital."
    )
    s = ev.score("Lyon. Paris is the capital.", ["Paris"], chat=True, lang="en")
    assert not s.correct  # a second sentence does not count


def test_answer_script_of_restated_replies() -> None:
    q = "ロシアの首都はどこですか？"
    kw = {"chat": True, "lang": "ja", "answers_zh": ["莫斯科"], "question": q}
    one = ["モスクワ"], ["Moscow"]
    assert ev.score("ロシアの首都はモスクワです。", *one, **kw).script == "query"
    # Latin letters added to a Japanese restatement: English, though most letters are kana
    assert ev.score("ロシアの首都はMoscowです。", *one, **kw).script == "latin"
    assert ev.score("ロシアの首都はMoskvaです。", *one, **kw).script == "latin"
    assert ev.score("ロシアの首都は莫斯科です。", *one, **kw).script == "han"
    ko = {"chat": True, "lang": "ko", "answers_zh": ["莫斯科"], "question": "러시아의 수도는?"}
    assert ev.score("러시아의 수도는 莫城입니다.", ["모스크바"], ["Moscow"], **ko).script == "han"
    # a Korean question answered in Japanese: another script, not Chinese
    s = ev.score("ロシアの首都はモスクワです。", ["모스크바"], ["Moscow"], **ko)
    assert (s.script, s.chinese) == ("other", False)


def test_chat_record_whose_answer_folds_to_empty_is_refused() -> None:
    from steerserve.tune.records import check_record

    rec = {"id": "x:1:ja", "lang": "ja", "answers": ["・"], "messages": [
        {"role": "user", "content": "?"}]}  # fmt: skip
    with pytest.raises(ValueError, match=r"record 'x:1:ja': accepted answers \['・'\] are empty"):
        check_record(rec, "d.jsonl:1")


def test_script_reads_past_a_gloss_and_knows_other_scripts() -> None:
    from steerserve.tune import scorer as sc

    kw = {"chat": True, "lang": "ja", "question": "インドの通貨は何ですか？"}
    s = sc.score("インドの通貨はインドポンド（INR）です。", ["ルピー"], ["Rupee"], **kw)
    assert s.script == "query"  # a wrong katakana name with a Latin gloss
    assert sc.score("インドの通貨はINRです。", ["ルピー"], ["Rupee"], **kw).script == "latin"
    ko = {"chat": True, "lang": "ko", "question": "키르기스스탄의 수도는 어디인가요?"}
    assert sc.score("키르기스스탄의 수도는 Таллин입니다.", ["비슈케크"], **ko).script == "other"
    ru = {"chat": True, "lang": "ru", "question": "Какая столица?"}
    assert sc.score("Столица — Москва.", ["Москва"], **ru).script == "query"


def test_accents_word_boundaries_and_echoed_english() -> None:
    """What the second blind reading found: readers accept a missing accent; a Latin answer
    inside a longer word is not the answer; an English name the question handed over is an
    echo, not the answer."""
    from steerserve.tune import scorer as sc

    es = {"chat": True, "lang": "es"}
    assert sc.score("El idioma oficial es el aleman.", ["alemán"], **es).correct
    assert sc.score("Amsterdam", ["Ámsterdam"], **es).correct
    fr = {"chat": True, "lang": "fr"}
    assert not sc.score("Somalie", ["somali"], ["Somali"], **fr).correct
    assert sc.score("La langue est le somali.", ["somali"], **fr).correct
    assert sc.score("Les États-Unis", ["États-Unis"], **fr).correct
    q = "「Chinese Yuan」は日本語で何と書きますか？"
    kw = {"chat": True, "lang": "ja", "question": q}
    s = sc.score("「Chinese Yuan」は日本語で「円」です。", ["人民元"], ["Chinese Yuan"], **kw)
    assert (s.correct, s.script, s.recall_any) == (False, "query", False)
    s = sc.score("Chinese Yuan", ["人民元"], ["Chinese Yuan"], **kw)
    assert s.script == "latin"  # nothing but the echo: the English answer
    s = sc.score("「Chinese Yuan」は日本語で「人民元」です。", ["人民元"], ["Chinese Yuan"], **kw)
    assert s.correct
