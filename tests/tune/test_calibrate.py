"""A small calibration through the vLLM engine on a tiny random model writes a valid artifact,
and the eval command reads it back (the same commands a GPU run uses, here with --device cpu)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from steerserve.artifacts import load_artifact
from steerserve.tune import calibrate as cal
from steerserve.tune import calibrate_logp as cl
from steerserve.tune.arms import UNSTEERED, arm_names
from steerserve.tune.extract import Candidates, ExtractConfig, extract
from steerserve.tune.hf import load_model


@pytest.fixture(scope="module")
def cands(tiny_gemma: Path) -> Candidates:
    model, tok = load_model(str(tiny_gemma))
    return extract(model, tok, ExtractConfig(per_lang=1, batch_size=8))


@pytest.fixture(scope="module")
def artifact_dir(tiny_gemma: Path, cands: Candidates, tmp_path_factory) -> Path:
    from steerserve.tune.evaluate import open_engine

    out = tmp_path_factory.mktemp("vec") / "tiny" / "v1"
    records = cal.calib_records(per_lang=1, en_items=2, shots=1, part=(0, 2))
    grid = cal.Grid(
        recall_variants=("recall.mixed.diff",),
        recall_layers=(1,),
        recall_scales=(0.5,),
        translation_layers=(2,),
        translation_scales=(0.5,),
        positions=("last_prompt_and_generated",),
        top_k=1,
        fine_factors=(2.0,),
    )
    eng = open_engine(tiny_gemma, dtype="float32", kv_cache_bytes=64 << 20, max_model_len=1024)
    try:
        # A steered sweep after the unsteered one shares its prompt KV (engine/prefix.py), which
        # must not change a steered result: the same as on an engine that never saw the prompts.
        sw = cal.Sweep(eng, cands, records)
        s = cal.Setting.at("recall.native.diff", 1, 2.0)
        sw.register(s)
        base, _ = cal.run_config(eng, records, None)
        shared, _ = cal.run_config(eng, records, [s.entry])
        eng.llm.reset_prefix_cache()
        fresh, _ = cal.run_config(eng, records, [s.entry])
        assert shared == fresh
        assert shared != base  # the steering does something, so the check means something
        result = cal.calibrate(eng, cands, records, grid, log=lambda *_: None)
        held = cal.calib_records(per_lang=1, en_items=1, shots=1, part=(1, 2))
        assert not {r["id"] for r in held} & {r["id"] for r in records}
        cal.confirm(eng, cands, result, held, log=lambda *_: None)
    finally:
        eng.shutdown()
    # unsteered, 1 recall, 1 translation, 1 joint, 2 fine
    assert [r["stage"] for r in result["sweep"]] == [
        "unsteered", "recall", "translation", "joint", "fine", "fine",
    ]  # fmt: skip
    cal.build_artifact(cands, result, tiny_gemma, out, "tiny", "v1")
    cal.write_summary(result, out.parent / "summary")
    assert "| joint |" in (out.parent / "summary" / "calibration.md").read_text()
    assert "held-out check (12 other" in (out.parent / "summary" / "calibration.md").read_text()
    return out


def test_calibration_artifact_loads(artifact_dir: Path, tiny_gemma: Path) -> None:
    art = load_artifact(artifact_dir, model_dir=tiny_gemma)
    m = art.manifest
    assert [iv.name for iv in m.interventions] == ["recall", "translation"]
    rec = m.intervention("recall")
    assert rec.layer == 1 and rec.positions == "last_prompt_and_generated"
    assert rec.scale in (0.5, 1.0)
    assert rec.calibration is not None and len(rec.calibration["sweep"]) == 6
    assert rec.calibration["chosen"]["recall"]["variant"] == "recall.mixed.diff"
    h = rec.calibration["holdout"]
    assert h["n_items"] == 12 and h["chosen"]["recall"] == rec.calibration["chosen"]["recall"]
    assert h["confirms"] == (h["non_en_gain"] > 0 and h["en_change"] >= -0.01)
    assert rec.provenance["extraction"]["fact_split"] == "train"


def test_cli_eval_on_dataset(artifact_dir: Path, tiny_gemma: Path, tmp_path: Path) -> None:
    """eval keeps every reply, counts the ones the budget cut and stops above the limit naming
    the budget, copies a declared plan into the report and never reruns a finished test."""
    from typer.testing import CliRunner

    from steerserve.cli import app
    from steerserve.tune.facts import eval_records

    ds = tmp_path / "d.jsonl"
    recs = eval_records("test", shots=1, langs=["en", "fr", "ja"], limit_per_lang=2)
    ds.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
    out = tmp_path / "eval"
    args = ["lab", "eval", "--model", str(tiny_gemma), "--artifact", str(artifact_dir),
            "--dataset", str(ds), "--out", str(out), "--dtype", "float32",
            "--kv-cache-memory-bytes", str(64 << 20), "--max-tokens", "3"]  # fmt: skip
    # The tiny random model never ends a line in 3 tokens: every reply is cut, the run stops.
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 1 and "by the 3-token budget" in res.output, res.output
    assert "limit 2%" in res.output
    plan = tmp_path / "plan.md"
    plan.write_text("Items: 6. Arms: all. Metric: non-English mean. Detectable: none (a test).")
    res = CliRunner().invoke(app, [*args, "--max-cut-share", "1", "--plan", str(plan)])
    assert res.exit_code == 0, res.output
    rep = json.loads((out / "report.json").read_text())
    assert set(rep["arms"]) == set(arm_names(load_artifact(artifact_dir)))
    assert rep["finished"] and rep["plan"]["text"].startswith("Items: 6.")
    for a in rep["arms"].values():
        assert set(a["per_language"]) == {"en", "fr", "ja"}
        assert a["per_language"]["fr"]["n"] == 2
        assert 0 <= a["non_english_mean"] <= 1
        assert a["replies"] == 6 and a["cut"] == 6 and a["cut_share"] == 1.0
        assert set(a["per_language"]["ja"]["script"]) == {"query", "latin", "han", "other"}
    assert "vs_unsteered" in rep["arms"]["both"]["per_language"]["ja"]
    replies = [json.loads(x) for x in (out / "replies.jsonl").read_text().splitlines()]
    assert len(replies) == 6 * len(rep["arms"])
    assert {"id", "lang", "arm", "text", "verdict", "why", "script", "tokens", "cut"} <= set(
        replies[0]
    )
    assert all(r["tokens"] == 3 and r["cut"] and "cut by the budget" in r["why"] for r in replies)
    md = (out / "report.md").read_text()
    assert "Plan, declared before the run" in md and "Answer script" in md
    assert (out / "accuracy.png").is_file()
    res = CliRunner().invoke(app, [*args, "--max-cut-share", "1", "--plan", str(plan)])
    assert res.exit_code != 0 and "a test runs once" in res.output


def test_evaluate_chunks_are_exact(artifact_dir: Path, tiny_gemma: Path) -> None:
    """All arms per chunk (prefix KV reused across arms) = one big chunk, item for item."""
    from steerserve.tune import evaluate as ev
    from steerserve.tune.facts import eval_records

    art = load_artifact(artifact_dir, model_dir=tiny_gemma)
    recs = eval_records("test", shots=1, langs=["en", "ko"], limit_per_lang=3)
    seen: list[int] = []
    eng = ev.open_engine(tiny_gemma, dtype="float32", kv_cache_bytes=64 << 20)
    try:
        small, _ = ev.evaluate(
            eng, art, recs, keep_texts=True, chunk=4, on_chunk=lambda n, *_: seen.append(n)
        )
        big, _ = ev.evaluate(eng, art, recs, keep_texts=True, chunk=100)
    finally:
        eng.shutdown()
    assert seen == [4, 6]
    arms = arm_names(art)
    for arm in arms:
        assert small[arm].texts == big[arm].texts and len(big[arm].texts) == 6
        assert small[arm].correct == big[arm].correct
    # Some arm's answers differ from the unsteered ones, so reusing the prefix KV was a real check.
    assert any(small[a].texts != small[UNSTEERED].texts for a in arms)


def test_grid_refuses_unknown_positions() -> None:
    with pytest.raises(ValueError, match="positions: \\['last_prompt'\\]; known: all"):
        cal.Grid(positions=("last_prompt_and_generated", "last_prompt"))
    assert cal.Grid.for_layers(28).recall_layers == (6, 9, 12, 16)


@pytest.mark.heavy  # builds the engine through the CLI (100 s here): not in test-fast
def test_cli_chat_form_calibrate_then_eval(cands: Candidates, tiny_gemma: Path, tmp_path: Path):
    """Chat records end to end: calibrate on chat records from a file (held-out half: every
    other record of each language), then eval on the built-in split in the artifact's form."""
    from typer.testing import CliRunner

    from steerserve.cli import app
    from steerserve.models.chat import chat_ids
    from steerserve.tune.evaluate import open_engine, record_prompts
    from steerserve.tune.facts import eval_records

    recs = eval_records("calib", langs=["en", "fr", "ja"], limit_per_lang=2, form="chat")
    eng = open_engine(tiny_gemma, dtype="float32", kv_cache_bytes=64 << 20)
    try:  # the engine reads exactly the server's rendering of each chat
        tok = eng.llm.get_tokenizer()
        assert record_prompts(eng, recs) == [chat_ids(tok, r["messages"]) for r in recs]
    finally:
        eng.shutdown()
    ds = tmp_path / "chat.jsonl"
    ds.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
    cpath = cands.save(tmp_path / "c.safetensors")
    out, summary = tmp_path / "vec" / "tiny" / "v1", tmp_path / "summary"
    common = [
        "--model",
        str(tiny_gemma),
        "--dtype",
        "float32",
        "--kv-cache-memory-bytes",
        str(64 << 20),
    ]
    args = ["lab", "calibrate", "--candidates", str(cpath), "--out", str(out), "--dataset", str(ds)]
    args += ["--holdout", "1", "--variants", "recall.native.diff", "--recall-layers", "1"]
    args += ["--recall-scales", "0.5", "--translation-layers", "2", "--translation-scales", "0.5"]
    args += ["--top-k", "1", "--fine", "", "--summary-dir", str(summary), *common]
    args += ["--objective", "accuracy"]  # the engine sweep (the default, logp, runs without one)
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    cal_json = json.loads((summary / "calibration.json").read_text())
    assert cal_json["grid"]["objective"] == "accuracy" and "item_ids" not in cal_json
    assert cal_json["n_items"] == 3 and cal_json["holdout"]["n_items"] == 3
    assert cal_json["scoring"]["form"] == "chat" and "chat form" in cal_json["prompts"]
    assert "<= 64 tokens" in cal_json["prompts"]
    ev_out = tmp_path / "eval"
    args = ["lab", "eval", "--artifact", str(out), "--out", str(ev_out), "--limit-per-lang", "1"]
    args += ["--arms", "unsteered,both", "--max-cut-share", "1", *common]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    rep = json.loads((ev_out / "report.json").read_text())
    assert rep["dataset"] == "built-in test split, chat form, 0-shot" and rep["n_items"] == 12
    assert rep["scoring"]["form"] == "chat"
    for a in rep["arms"].values():
        assert {"n", "accuracy", "ci95", "english_rate", "chinese_rate"} <= set(
            a["per_language"]["ja"]
        )
        assert 0 <= a["non_english_mean"] <= 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**recs[0], "messages": [{"role": "bot", "content": "x"}]}) + "\n")
    res = CliRunner().invoke(
        app, ["lab", "eval", "--dataset", str(bad), "--artifact", str(out), *common]
    )
    assert res.exit_code != 0 and "capital_of" in res.output and "'bot'" in res.output


@pytest.mark.heavy  # a whole log-P sweep (60 s here): not in test-fast
def test_logp_protocol_selects_on_one_half_and_confirms_on_the_other(
    tiny_gemma: Path, cands: Candidates, tmp_path: Path
) -> None:
    import torch

    from steerserve.tune.runner import Runner

    with pytest.raises(ValueError, match="objective"):
        cal.Grid(objective="luck", recall_layers=(1,), translation_layers=(2,))
    n_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: a second thread only waits on a shared CPU
    try:
        model, tok = load_model(str(tiny_gemma))
        scorer = Runner(model, tok, batch_size=16)
        records = cal.calib_records(per_lang=1, en_items=2, shots=1, part=(0, 2))
        held = cal.calib_records(per_lang=1, en_items=1, shots=1, part=(1, 2))
        grid = cal.Grid(
            objective="logp",
            recall_variants=("recall.mixed.diff",),
            recall_layers=(1, 2),
            recall_scales=(0.5,),
            translation_layers=(2,),
            translation_scales=(0.5, 1.0),
            positions=("last_prompt_and_generated", "all"),
            top_k=1,
            fine_factors=(2.0,),
        )
        result = cl.calibrate_logp(scorer, cands, records, grid, log=lambda *_: None)
        cl.confirm_logp(scorer, cands, result, held, log=lambda *_: None)
    finally:
        torch.set_num_threads(n_threads)
    sweep = result["sweep"]
    assert [r["stage"] for r in sweep] == [UNSTEERED, "recall", "recall", "translation",
                                           "translation", "joint", "fine", "fine", "positions"]  # fmt: skip
    assert sweep[0]["d_logp"] == 0 and sweep[0]["d_logp_ci95"] == [0, 0]
    assert sweep[-1]["recall"]["positions"] == "all"
    pairs = [r for r in sweep if r["recall"] and r["translation"]]
    ok = [r for r in pairs if r["en_d_logp"] >= -grid.max_en_logp_drop]
    assert result["chosen"]["d_logp"] == max(r["d_logp"] for r in ok or pairs)
    assert any(abs(r["d_logp"]) > 1e-3 for r in sweep[1:])  # the steering moves log P
    h = result["holdout"]
    assert h["n_items"] == len(held) and h["chosen"]["recall"] == result["chosen"]["recall"]
    assert h["rule"] == cl.CONFIRM_RULE["completion"]
    assert h["confirms"] == (
        h["d_logp_ci95"][0] > 0
        and h["non_en_gain"] >= 0
        and h["en_change"] >= -grid.max_en_drop
        and h["chosen"]["en_d_logp"] >= -grid.max_en_logp_drop
    )
    out = tmp_path / "tiny" / "v1"
    cal.build_artifact(cands, result, tiny_gemma, out, "tiny", "v1")
    art = load_artifact(out, model_dir=tiny_gemma)
    assert art.manifest.intervention("recall").calibration["grid"]["objective"] == "logp"
    md = (cal.write_summary(result, tmp_path / "summary") / "calibration.md").read_text()
    assert "held-out Δ log P(gold)" in md and "Δ log P [95 % CI]" in md


def test_cli_calibrate_default_logp_selects_and_confirms_on_disjoint_halves(
    cands: Candidates, tiny_gemma: Path, tmp_path: Path
) -> None:
    """The default objective end to end: the pair is chosen by Δ log P(gold) on one half of the
    calibration facts and re-checked on the other half (no fact in both), in transformers; the
    artifact and the echo both carry the verdict."""
    import torch
    from typer.testing import CliRunner

    from steerserve.cli import app

    cpath = cands.save(tmp_path / "c.safetensors")
    out, summary = tmp_path / "vec" / "tiny" / "v1", tmp_path / "summary"
    args = ["lab", "calibrate", "--candidates", str(cpath), "--out", str(out), "--model", str(tiny_gemma),
            "--per-lang", "1", "--en-items", "2", "--shots", "1",
            "--variants", "recall.mixed.diff", "--recall-layers", "1", "--recall-scales", "0.5",
            "--translation-layers", "2", "--translation-scales", "0.5", "--top-k", "1",
            "--fine", "", "--cpu-threads", "0", "--batch-size", "16",
            "--summary-dir", str(summary)]  # fmt: skip
    n_threads = torch.get_num_threads()
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert torch.get_num_threads() == n_threads  # one thread while scoring, then restored
    c = load_artifact(out, model_dir=tiny_gemma).manifest.intervention("recall").calibration
    assert c is not None and c["grid"]["objective"] == "logp" and "_winner" not in c
    assert [r["stage"] for r in c["sweep"]] == [UNSTEERED, "recall", "translation", "joint"]
    h = c["holdout"]
    sel, held = c["item_ids"], h["item_ids"]
    # --holdout 0: the held-out half has as many facts per language as the selection (1, en 2)
    assert h["n_items"] == len(held) == len(sel) == c["n_items"] == 13
    assert sorted(i.rsplit(":", 1)[1] for i in held) == sorted(i.rsplit(":", 1)[1] for i in sel)
    assert not {i.rsplit(":", 1)[0] for i in sel} & {i.rsplit(":", 1)[0] for i in held}
    assert h["chosen"]["recall"] == c["chosen"]["recall"] and "d_logp_ci95" in h
    assert (
        json.loads((summary / "calibration.json").read_text())["holdout"]["confirms"]
        == (h["confirms"])
    )
    assert "held-out half (13 items, other facts): non-English Δ log P(gold)" in res.output
    if h["confirms"]:
        assert "confirmed on the held-out half" in res.output
    else:
        assert "DID NOT CONFIRM" in res.output and "do not ship it" in res.output
    res = CliRunner().invoke(app, ["lab", "calibrate", "--out", str(out), "--objective", "luck"])
    assert res.exit_code != 0 and "--objective" in res.output and "'luck'" in res.output


def test_a_chat_recheck_confirms_only_when_accuracy_rises() -> None:
    """log P after a chat prompt also rewards bare-name replies, so a chat re-check needs
    accuracy to rise; a completion re-check only needs it not to fall."""
    grid = {"max_en_drop": 0.01, "max_en_logp_drop": 0.1}
    ok = dict(d_logp_lo=0.2, en_change=0.0, en_d_logp=0.0, grid=grid)
    assert cl.holdout_confirms(d_acc=0.0, chat=False, **ok)
    assert not cl.holdout_confirms(d_acc=0.0, chat=True, **ok)
    assert cl.holdout_confirms(d_acc=0.02, chat=True, **ok)
    assert not cl.holdout_confirms(d_acc=-0.01, chat=False, **ok)
    assert not cl.holdout_confirms(d_acc=0.02, chat=True, **{**ok, "d_logp_lo": -0.01})
    assert not cl.holdout_confirms(d_acc=0.02, chat=False, **{**ok, "en_change": -0.05})
    assert not cl.holdout_confirms(d_acc=0.02, chat=False, **{**ok, "en_d_logp": -0.2})
