"""Extraction on a tiny random model: shapes, determinism, the layer convention, the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from steerserve.tune.extract import (
    NORM_KEY,
    Candidates,
    ExtractConfig,
    extract,
    last_token_means,
    mixed_prompt,
    prompt_groups,
    translation_prompt,
    unit_scaled,
)
from steerserve.tune.facts import load_facts, query
from steerserve.tune.hf import load_model

CFG = ExtractConfig(per_lang=2, langs=("en", "fr", "ja"), batch_size=3)


@pytest.fixture(scope="module")
def tiny(tiny_gemma: Path):
    return load_model(str(tiny_gemma))


def test_prompts_are_what_the_variants_say() -> None:
    ja = load_facts("train", ["ja"], ["capital_of"])[0]
    mixed = mixed_prompt(ja, 3, 0)
    assert mixed.endswith(query(ja))
    assert mixed.startswith("Country: ")  # English demonstrations, Japanese query
    assert mixed.count("\n") == 3
    assert translation_prompt("Paris", "fr", [("Rome", "Rome")]) == (
        "English: Rome → French: Rome\nEnglish: Paris → French:"
    )
    g = prompt_groups(CFG)
    assert len(g["zero.native"]) == 6 and len(g["translation"]) == 4
    assert all(p.count("\n") == 5 for p in g["fewshot.native"])  # 5-shot task-vector prompts


def test_shapes_and_determinism(tiny) -> None:
    model, tok = tiny
    a = extract(model, tok, CFG)
    b = extract(model, tok, ExtractConfig(**{**CFG.__dict__, "batch_size": 1}))
    n_layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    assert set(a.names) == {
        "recall.en.raw", "recall.en.diff", "recall.native.raw", "recall.native.diff",
        "recall.mixed.raw", "recall.mixed.diff", "translation",
    }  # fmt: skip
    for name in a.names:
        assert a.tensors[name].shape == (n_layers, hidden)
        assert torch.isfinite(a.tensors[name]).all()
        # batch composition and padding must not change the result
        torch.testing.assert_close(a.tensors[name], b.tensors[name], atol=1e-4, rtol=1e-4)
    assert a.tensors[NORM_KEY].shape == (n_layers,)
    v = unit_scaled(a, "translation", 1)
    assert float(v.norm()) == pytest.approx(float(a.tensors[NORM_KEY][1]), rel=1e-5)


def test_hook_matches_hidden_states(tiny) -> None:
    """Block L's output is transformers' hidden_states[L+1] (the last one is post-norm there)."""
    model, tok = tiny
    p = "Country: France. Capital:"
    mean, _ = last_token_means(model, tok, [p], batch_size=1)
    ids = tok(p, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
    for layer in range(model.config.num_hidden_layers - 1):
        torch.testing.assert_close(mean[layer], hs[layer + 1][0, -1].float(), atol=1e-4, rtol=1e-4)


def test_save_load_roundtrip(tiny, tmp_path: Path) -> None:
    model, tok = tiny
    c = extract(model, tok, ExtractConfig(per_lang=1, langs=("en", "de"), batch_size=4))
    path = c.save(tmp_path / "c.safetensors")
    d = Candidates.load(path)
    assert d.meta["groups"] == c.meta["groups"]
    torch.testing.assert_close(d.tensors["translation"], c.tensors["translation"])


def test_cli_extract_cpu(tiny_gemma: Path, tmp_path: Path) -> None:
    """The GPU command line (--model PATH --device --dtype) on CPU, through the same command."""
    from typer.testing import CliRunner

    from steerserve.cli import app

    out = tmp_path / "cands.safetensors"
    args = ["lab", "extract", "--model", str(tiny_gemma), "--device", "cpu", "--dtype", "float32",
            "--per-lang", "1", "--langs", "en,fr", "--batch-size", "2", "--out", str(out)]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    c = Candidates.load(out)
    assert c.meta["device"] == "cpu" and c.tensors["translation"].shape == (4, 64)


def test_chat_groups_mirror_the_completion_construction() -> None:
    from steerserve.tune.facts.chat import INSTRUCTION, question

    cfg = ExtractConfig(**{**CFG.__dict__, "form": "chat"})
    g, c = prompt_groups(cfg), prompt_groups(CFG)
    assert {k: len(v) for k, v in g.items()} == {k: len(v) for k, v in c.items()}
    zero, few, mixed = g["zero.native"][2], g["fewshot.native"][2], g["fewshot.mixed"][0]
    assert [m["role"] for m in zero] == ["system", "user"]
    assert few[0] == zero[0] and few[-1] == zero[-1]  # same instruction and question
    assert [m["role"] for m in few[1:-1]] == ["user", "assistant"] * 5
    fr = load_facts("train", ["fr"])[0]
    assert mixed[0]["content"] == INSTRUCTION["fr"] and mixed[-1]["content"] == question(fr)
    assert mixed[1]["content"].startswith("What is the capital of")  # English demonstrations
    tr = g["translation"][0]
    assert tr[-1]["content"] == f"Translate into French: {fr.answers_en[0]}"
    assert [m["role"] for m in tr] == ["system"] + ["user", "assistant"] * 3 + ["user"]
    assert [m["role"] for m in g["recall.non_en"][0]] == [m["role"] for m in tr]


def test_chat_means_are_read_where_the_reply_starts(tiny) -> None:
    """A chat's state is the last token of the server's rendering of it."""
    from steerserve.models.chat import chat_ids

    model, tok = tiny
    msgs = [{"role": "system", "content": "Name only."}, {"role": "user", "content": "Capital?"}]
    mean, _ = last_token_means(model, tok, [msgs, "Capital:"], batch_size=2)
    h = []
    for ids in (chat_ids(tok, msgs), tok("Capital:")["input_ids"]):
        with torch.no_grad():
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        h.append(hs[2][0, -1].float())
    torch.testing.assert_close(mean[1], (h[0] + h[1]) / 2, atol=1e-4, rtol=1e-4)
    c = extract(
        model, tok, ExtractConfig(per_lang=1, langs=("en", "ja"), batch_size=4, form="chat")
    )
    assert c.meta["form"] == "chat" and torch.isfinite(c.tensors["translation"]).all()


def test_recall_sources_limit_the_groups() -> None:
    cfg = ExtractConfig(**{**CFG.__dict__, "recall_sources": ("native",), "form": "chat"})
    assert set(prompt_groups(cfg)) == {
        "zero.native", "fewshot.native", "translation", "recall.non_en",
    }  # fmt: skip
    with pytest.raises(ValueError, match="unknown recall sources"):
        prompt_groups(ExtractConfig(recall_sources=("german",)))
