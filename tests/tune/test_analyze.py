"""Diagnosis on a tiny random model: lens = model logits, ranks, the failure split on constructed
cases, greedy parity with the reference decoder, steering seen by the lens, report and plots."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from steerserve import artifacts as A
from steerserve.engine.spec import SteeringEntry
from steerserve.tune import analyze as an
from steerserve.tune import analyze_report as ar
from steerserve.tune.hf import decoder_layers, load_model
from steerserve.tune.reference import greedy

PROMPTS = ["Capital: Rome\nCapital:", "国：日本。首都：東京\n国：法国。首都：", "Abc"]


@pytest.fixture(scope="module")
def tiny(tiny_gemma: Path):
    return load_model(str(tiny_gemma))


def _records(n: int = 2) -> list[dict]:
    """Evaluation-format records; ``sep`` "" so the byte tokenizer's first token is a letter."""
    out = []
    for i in range(n):
        for lang, ans, en in (("en", "Paris", "Paris"), ("fr", "Londres", "London")):
            out.append(
                {
                    "id": f"{i}:{lang}",
                    "lang": lang,
                    "prompt": f"Q{i} {lang}: capital?",
                    "answers": [ans],
                    "answers_en": [en],
                    "sep": "",
                }
            )
    return out


def _artifact(model_dir: Path, out: Path, hidden: int, version: str = "v1") -> A.Artifact:
    g = torch.Generator().manual_seed(0)
    ivs = [
        A.Intervention(
            name="recall",
            tensor="recall",
            layer=1,
            scale=2.0,
            positions="last_prompt_and_generated",
        ),
        A.Intervention(name="translation", tensor="translation", layer=2, scale=1.0),
    ]
    m = A.Manifest(
        name="tiny", version=version, model=A.binding_for_model(model_dir), interventions=ivs
    )
    ts = {k: torch.randn(hidden, generator=g) for k in ("recall", "translation")}
    return A.save_artifact(out, m, ts)


# --- ranks and classification on constructed cases ---------------------------------------------


def test_best_rank_is_one_based_and_takes_the_best_alias() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0], [5.0, 0.0, 0.0, 1.0, 4.0]])
    r, p = an.best_rank(logits, [2])
    assert r.tolist() == [3.0, 4.0]  # row 1: 5, 1 and 4 are above 0; the tie does not count
    r, p = an.best_rank(logits, [2, 3])  # aliases: the better-ranked one, per row
    assert r.tolist() == [2.0, 3.0]
    probs = torch.softmax(logits, -1)
    assert np.allclose(p, [probs[0, 3], probs[1, 3]])
    r, p = an.best_rank(logits, [1])
    assert r.tolist() == [1.0, 4.0]
    r, p = an.best_rank(logits, [])
    assert np.isnan(r).all() and (p == 0).all()


def test_classify_recall_vs_conversion_respects_threshold_and_window() -> None:
    n_layers, lo, hi, th = 6, 3, 5, 10
    far = np.full(n_layers + 1, 5000.0)
    conv = far.copy()
    conv[hi + 1] = 10  # block hi (lens index hi + 1) reaches the threshold exactly
    early = far.copy()
    early[: lo + 1] = 1  # top-1 at the embeddings .. block lo - 1: outside the window
    assert an.classify(False, conv, lo, hi, th) == "conversion"
    assert an.classify(False, far, lo, hi, th) == "recall"
    assert an.classify(False, early, lo, hi, th) == "recall"
    assert an.classify(False, conv, lo, hi, 9) == "recall"
    assert an.classify(True, far, lo, hi, th) == "correct"
    assert an.classify(False, np.full(n_layers + 1, np.nan), lo, hi, th) == "unknown"
    assert ar.first_layer(conv, th) == hi and ar.first_layer(early, th) == -1
    assert ar.first_layer(far, th) is None
    assert an.LensConfig().blocks(18) == (9, 17)
    with pytest.raises(ValueError, match="outside"):
        an.LensConfig(window=(4, 18)).blocks(18)


def _item(lang: str, correct: bool, en_rank: list[float], english: bool = False) -> an.Item:
    r = np.array(en_rank, dtype=float)
    it = an.Item("x", lang, "a", correct, english, correct or english, r, r, r * 0, r * 0, False)
    it.cls = an.classify(correct, r, 2, 3, 10)
    return it


def test_summary_and_transitions_on_known_items() -> None:
    recall = _item("fr", False, [900, 800, 700, 600, 500])  # never <= 10 in blocks 2..3
    conversion = _item("fr", False, [900, 800, 700, 3, 500], english=True)
    correct = _item("fr", True, [900, 800, 50, 2, 1])
    english = _item("en", True, [1, 1, 1, 1, 1])
    s = ar.summarise([recall, conversion, correct], threshold=10)
    f = s["failures"]
    assert (f["recall"], f["conversion"], f["correct"], f["wrong"]) == (1, 1, 1, 2)
    assert f["recall_share"] == f["conversion_share"] == 0.5
    assert f["answered_in_english"] == 1
    assert s["accuracy"] == pytest.approx(1 / 3) and s["english_rate"] == pytest.approx(1 / 3)
    assert s["median_rank_en"] == [900, 800, 700, 3, 500]
    assert s["en_first_layer_median"] == 2  # both first reach rank <= 10 at lens index 3
    assert s["en_above_target_share"] == [0.0] * 5  # target == English ranks in these items
    pivot = _item("fr", True, [5, 5, 5, 5, 5])
    pivot.tgt_rank = np.array([1.0, 9, 9, 5, 1])
    assert ar.summarise([pivot], 10)["en_above_target_share"] == [0, 1, 1, 0, 0]
    pivot.shared_first_token = True  # the same token for both answers: left out
    assert ar.summarise([pivot], 10)["en_above_target_share"] == []
    fixed_recall = _item("fr", True, [900, 800, 700, 600, 1])
    t = ar.transitions([recall, conversion, english], [fixed_recall, conversion, english])
    assert t["fixed"] == 1 and t["recall_fixed"] == 1 and t["conversion_fixed"] == 0
    assert t["broken"] == 0 and t["from_english"] == 0


def test_sensitivity_recomputes_the_split_from_item_ranks() -> None:
    items = [  # window blocks 1..2 = lens indices 2..3; index 0 (embeddings) is outside
        {"id": "a:fr", "class": "recall", "en_rank": [1, 500, 40, 200], "target_rank": [1] * 4},
        {"id": "b:fr", "class": "conversion", "en_rank": [1, 500, 2, 300], "target_rank": [1] * 4},
        {"id": "c:fr", "class": "correct", "en_rank": [1] * 4, "target_rank": [1] * 4},
        {"id": "d:en", "class": "recall", "en_rank": [999] * 4, "target_rank": [999] * 4},
    ]
    rep = {"window": [1, 2], "arms": {"unsteered": {"items": items}}}
    rows = {r["threshold"]: r for r in ar.sensitivity(rep, "unsteered")}
    assert [rows[t]["conversion_share"] for t in ar.SENSITIVITY] == [0.0, 0.5, 0.5, 0.5, 1.0]
    assert rows[10]["n_wrong"] == 2 and rows[10]["n_distinct"] == 2


def test_first_tokens_in_context(tiny) -> None:
    _, tok = tiny
    p = "Capital:"
    # byte-level tokenizer: " Paris" starts with a bare space token, which says nothing
    assert an.first_tokens(tok, p, " ", ["Paris"]) == []
    got = an.first_tokens(tok, p, "", ["Paris", "Prague", "Rome"])
    assert got == tok.convert_tokens_to_ids(["P", "R"])  # deduplicated, in order


# --- forward passes on the tiny model ----------------------------------------------------------


def test_lens_shapes_and_last_point_equals_model_logits(tiny) -> None:
    model, tok = tiny
    model.config.final_logit_softcapping = 3.0  # exercise the softcap path too
    try:
        hidden, texts = an.lens_and_greedy(model, tok, PROMPTS, max_tokens=1)
        n = len(decoder_layers(model))
        assert hidden.shape == (len(PROMPTS), n + 1, model.config.hidden_size)
        assert len(texts) == len(PROMPTS)
        head = an.lens_head(model)
        for i, p in enumerate(PROMPTS):
            out = model(**tok(p, return_tensors="pt"), output_hidden_states=True)
            ref = out.logits[0, -1]
            assert torch.allclose(head(hidden[i, -1:])[0], ref, atol=1e-4)
            assert ref.abs().max() <= 3.0
            # every point is transformers' hidden_states[i] (the last one before the final norm)
            hs = out.hidden_states
            for j in range(n):
                assert torch.allclose(hidden[i, j], hs[j][0, -1], atol=1e-4)
    finally:
        model.config.final_logit_softcapping = None


@pytest.mark.parametrize("positions", ["last_prompt_and_generated", "all", None])
def test_greedy_matches_reference_and_lens_sees_steering(tiny, positions: str | None) -> None:
    model, tok = tiny
    h = model.config.hidden_size
    v = torch.randn(h, generator=torch.Generator().manual_seed(1))
    entries = [SteeringEntry("v", 1, 3.0, positions)] if positions else []
    hidden, texts = an.lens_and_greedy(model, tok, PROMPTS, 5, entries, {"v": v})
    for p, text in zip(PROMPTS, texts, strict=True):
        ids, _ = greedy(model, tok(p)["input_ids"], 5, entries, {"v": v})
        ids = ids[: ids.index(tok.eos_token_id)] if tok.eos_token_id in ids else ids
        assert text.split("\n")[0] == tok.decode(ids, skip_special_tokens=True).split("\n")[0]
    if positions == "last_prompt_and_generated":  # only the last token moves: block 1 exactly
        base, _ = an.lens_and_greedy(model, tok, PROMPTS, 1)
        assert torch.allclose(hidden[:, :2], base[:, :2], atol=1e-5)  # emb, block 0
        assert torch.allclose(hidden[:, 2] - base[:, 2], 3.0 * v.expand(3, h), atol=1e-4)


def test_run_report_and_plots(tiny, tiny_gemma: Path, tmp_path: Path) -> None:
    model, tok = tiny
    art = _artifact(tiny_gemma, tmp_path / "art", model.config.hidden_size)
    recs = _records(2)
    cfg = an.LensConfig(threshold=50, max_tokens=3, batch_size=3)
    seen: list[str] = []
    results, times = an.run(
        model, tok, recs, cfg, ("unsteered", "recall", "both", "random"), art,
        on_arm=lambda r, t: seen.append(list(r)[-1]),
    )  # fmt: skip
    assert seen == ["unsteered", "recall", "both", "random"] and set(times) == set(seen)
    n = len(decoder_layers(model))
    for items in results.values():
        assert [it.id for it in items] == [r["id"] for r in recs]
        for it in items:
            assert it.en_rank.shape == (n + 1,) and np.all(it.en_rank >= 1)
            assert it.cls in an.CLASSES
            assert (it.lang == "en") <= (it.en_rank == it.tgt_rank).all()  # same answer in en
    # the recall vector is added at block 1: the lens before it is untouched, after it is not
    a, b = results["unsteered"][1], results["recall"][1]
    assert np.array_equal(a.en_rank[:2], b.en_rank[:2])
    pairs = zip(results["unsteered"], results["both"], strict=True)
    assert any(not np.array_equal(x.en_rank, y.en_rank) for x, y in pairs)
    rep = ar.build_report(results, cfg, n, {"model": "tiny", "n_items": len(recs)})
    assert rep["window"] == [n // 2, n - 1] and len(rep["lens_points"]) == n + 1
    ne = rep["arms"]["unsteered"]["non_english"]
    assert ne["n"] == 2 and len(ne["median_rank_en"]) == n + 1
    assert "vs_unsteered" in rep["arms"]["both"] and "vs_unsteered" not in rep["arms"]["unsteered"]
    out = ar.write_report(json.loads(json.dumps(rep)), tmp_path / "rep")  # JSON-safe
    md = (out / "report.md").read_text()
    assert "## Failure breakdown" in md and "| both |" in md and "## Findings" in md
    conv = [r["conversion_share"] for r in ar.sensitivity(rep, "unsteered")]
    assert all(a is None or a <= b for a, b in zip(conv, conv[1:], strict=False))
    import matplotlib.image as mpimg

    for name in (
        "lens_unsteered",
        "lens_recall",
        "lens_both",
        "lens_random",
        "lens_arms",
        "failures",
    ):
        png = out / f"{name}.png"
        img = mpimg.imread(png)
        assert png.stat().st_size > 5000 and img.shape[0] > 200 and img.std() > 0.05


def test_sample_draws_the_same_positions_in_every_language() -> None:
    recs = _records(6)
    got = an.sample(recs, 2, seed=3)
    ids = [r["id"] for r in got]
    assert len(ids) == 4 and ids == [r["id"] for r in recs if r["id"] in ids]  # file order
    en = [i.split(":")[0] for i in ids if i.endswith(":en")]
    fr = [i.split(":")[0] for i in ids if i.endswith(":fr")]
    assert en == fr  # translations stay aligned
    assert an.sample(recs, 2, seed=3) == got
    draws = {tuple(r["id"] for r in an.sample(recs, 2, seed=k)) for k in range(8)}
    assert len(draws) > 1  # random, not the first N (the facts are ordered by prominence)
    assert [r["id"] for r in an.sample(recs, 0, ["fr"])] == [f"{i}:fr" for i in range(6)]
    assert len(an.sample(recs, 99)) == len(recs)


def test_cli_analyze(tiny_gemma: Path, tmp_path: Path) -> None:
    from steerserve.cli import app

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _records(2)))
    art = _artifact(tiny_gemma, tmp_path / "art", 64)
    out = tmp_path / "out"
    args = ["lab", "analyze", "--model", str(tiny_gemma), "--dataset", str(data), "--out", str(out)]
    args += ["--artifact", str(art.path), "--arms", "unsteered,translation", "--sample", "1"]
    args += ["--threshold", "100", "--window", "1,3", "--max-tokens", "2"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    rep = json.loads((out / "report.json").read_text())
    assert rep["n_items"] == 2 and rep["window"] == [1, 3] and rep["threshold"] == 100
    assert list(rep["arms"]) == ["unsteered", "translation"]
    assert (out / "lens_translation.png").stat().st_size > 0
    bad = CliRunner().invoke(app, [*args[:9], "--arms", "unsteered,nope"])
    assert bad.exit_code != 0


def test_cli_analyze_defaults_to_the_artifact_auto_serves(tiny_gemma: Path, tmp_path: Path) -> None:
    """No --artifact: the artifact the server would serve for the model from --vectors-dir; none
    there: a failure naming what is missing, unless only the unsteered arm is asked for."""
    from steerserve.cli import app

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _records(1)))
    vectors = tmp_path / "vectors"
    base = ["lab", "analyze", "--model", str(tiny_gemma), "--dataset", str(data), "--sample", "1"]
    base += ["--max-tokens", "1", "--vectors-dir", str(vectors)]
    res = CliRunner().invoke(app, [*base, "--out", str(tmp_path / "a")])
    assert res.exit_code == 1 and "no steering artifact" in res.output, res.output
    assert "--arms unsteered" in res.output
    res = CliRunner().invoke(app, [*base, "--out", str(tmp_path / "b"), "--arms", "unsteered"])
    assert res.exit_code == 0, res.output
    assert list(json.loads((tmp_path / "b" / "report.json").read_text())["arms"]) == ["unsteered"]
    _artifact(tiny_gemma, vectors / "tiny" / "v1", 64)
    _artifact(tiny_gemma, vectors / "tiny" / "v2", 64, "v2")
    res = CliRunner().invoke(app, [*base, "--out", str(tmp_path / "c")])
    assert res.exit_code == 0, res.output
    rep = json.loads((tmp_path / "c" / "report.json").read_text())
    assert rep["artifact"] == "tiny/v2"  # the newest version, as the server's default
    assert list(rep["arms"]) == ["unsteered", "recall", "translation", "both"]


# --- chat records -----------------------------------------------------------------------------


def test_chat_records_rank_the_reply_start_and_the_chinese_answer(tiny) -> None:
    """A chat's lens point is the last token of the server's rendering; the answers' first
    tokens are the reply's; the Chinese answer is ranked too, and the pivot reads it."""
    from steerserve.models.chat import chat_ids

    model, tok = tiny
    msgs = [{"role": "system", "content": "名前だけ"}, {"role": "user", "content": "首都？"}]
    recs = [
        {"id": f"{i}:{lang}", "lang": lang, "messages": msgs, "answers": [ans],
         "answers_en": ["Paris"], "answers_zh": ["巴黎"]}
        for i in range(3) for lang, ans in (("ja", "パリ"), ("en", "Paris"))
    ]  # fmt: skip
    cfg = an.LensConfig(threshold=50, max_tokens=2, batch_size=4)
    items = an.analyze_arm(model, tok, recs, cfg)
    hidden, texts = an.lens_and_greedy(model, tok, [chat_ids(tok, msgs)], 2)
    logits = an.lens_head(model)(hidden[0])
    first = {a: tok(a, add_special_tokens=False)["input_ids"][0] for a in ("パリ", "Paris", "巴黎")}
    it = items[0]
    assert np.array_equal(it.tgt_rank, an.best_rank(logits, [first["パリ"]])[0])
    assert np.array_equal(it.en_rank, an.best_rank(logits, [first["Paris"]])[0])
    assert np.array_equal(it.zh_rank, an.best_rank(logits, [first["巴黎"]])[0])
    assert it.answer == texts[0].split("\n")[0].strip()
    n = len(decoder_layers(model))
    rep = ar.build_report({"unsteered": items}, cfg, n, {"model": "tiny"})
    pv = rep["pivot"]["per_language"]["ja"]
    assert pv["n"] == 3 and pv["pivot"] in ("zh", "en", "tie")
    lo, hi = ar.pivot_window(n)
    share = float(np.mean((it.zh_rank < it.en_rank)[lo + 1 : hi + 2]))
    assert pv["zh_above_en_share"] == pytest.approx(share)  # three identical items
    assert len(rep["arms"]["unsteered"]["per_language"]["ja"]["median_rank_zh"]) == n + 1
    assert "## Pivot language" in ar.report_markdown(json.loads(json.dumps(rep)))


def test_cli_analyze_chat_form(tiny_gemma: Path, tmp_path: Path) -> None:
    from steerserve.cli import app

    out = tmp_path / "out"
    args = ["lab", "analyze", "--model", str(tiny_gemma), "--form", "chat", "--langs", "en,ja,ko"]
    args += ["--sample", "1", "--arms", "unsteered", "--max-tokens", "2", "--out", str(out)]
    args += ["--vectors-dir", str(tmp_path / "none")]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    rep = json.loads((out / "report.json").read_text())
    assert rep["dataset"] == "built-in test split, chat form, 0-shot" and rep["n_items"] == 3
    assert set(rep["pivot"]["per_language"]) <= {"en", "ja", "ko"}
    assert rep["arms"]["unsteered"]["items"][1]["zh_rank"] is not None
