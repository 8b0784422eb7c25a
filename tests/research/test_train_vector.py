"""steerserve train-vector on the tiny Gemma: a learned vector that raises what it trains on,
saved as an ordinary artifact; bad training sets refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from steerserve.artifacts import load_artifact
from steerserve.cli import app
from steerserve.research import train_vector as tv

pytestmark = pytest.mark.usefixtures("one_thread")


def test_train_vector_end_to_end(tiny_gemma: Path, tmp_path: Path) -> None:
    out, rep = tmp_path / "vec" / "tiny" / "v9", tmp_path / "rep"
    args = ["lab", "train-vector", "--model", str(tiny_gemma), "--out", str(out), "--layer", "1",
            "--langs", "en,fr,ja", "--relations", "capital_of", "--steps", "6",
            "--batch-size", "4", "--dtype", "float32", "--report-dir", str(rep),
            "--lr", "0.2"]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    art = load_artifact(out, model_dir=tiny_gemma)
    (iv,) = art.manifest.interventions
    assert (iv.name, iv.layer, iv.scale, iv.positions) == (
        "learned",
        1,
        1.0,
        "last_prompt_and_generated",
    )
    prov = iv.provenance
    assert prov["relations_held_out"] == ["city_in", "language_of", "currency_of"]
    assert set(prov["train_items"]).isdisjoint(prov["validation_items"])
    assert prov["prefixes"]["counts"]  # where each item's log P was taken
    curve = json.loads((rep / "curve.json").read_text())
    assert len(curve["loss"]) >= 1 and curve["val"][0][0] == 0
    assert curve["best_val"] >= curve["val"][0][1]  # the kept vector is the best seen
    v = art.tensors["learned"]
    assert 0 < float(v.norm()) <= 0.5 * prov["mean_residual_norm"] + 1e-4  # the norm cap
    conf = [json.loads(x) for x in (rep / "confirmation.jsonl").read_text().splitlines()]
    train_ids = set(prov["train_items"]) | set(prov["validation_items"])
    assert conf and train_ids.isdisjoint(r["id"] for r in conf)  # no fact in both
    assert {r["held_out_relation"] for r in conf} == {True, False}


def test_training_sets_are_checked() -> None:
    with pytest.raises(ValueError, match="no gold answer"):
        tv.check_training_set([{"id": "a", "lang": "ja", "answers": []}])
    few = [{"id": str(i), "lang": "ja", "answers": ["x"]} for i in range(3)]
    with pytest.raises(ValueError, match=r"too few non-English training items .*'ja': 3"):
        tv.check_training_set(few)


def test_cached_prompt_equals_a_full_forward(tiny_gemma: Path) -> None:
    """The vector from the last prompt token on, over a cached prompt, gives the logits of a
    full forward with the same addition; and it changes them (the test can fail)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_gemma, dtype=torch.float32).eval()
    items = [
        tv.Item("a", "ja", [5, 6, 7, 8, 9, 10], steer_from=3, gold_from=5),
        tv.Item("b", "ja", [11, 12, 13, 14, 15, 16, 17, 18], steer_from=4, gold_from=7),
    ]
    v = torch.randn(model.config.hidden_size)
    with tv.Steered(model, 1, pad=0) as hook:
        (batch,) = tv.prepare(model, items, 2, pad=0)
        cached = tv._forward(model, hook, batch, v)
        plain = tv._forward(model, hook, batch, None)
        for r, it in enumerate(items):
            ids = torch.tensor([it.ids])
            hook.v = v
            hook.mask = torch.zeros(1, len(it.ids), 1)
            hook.mask[0, it.steer_from :] = 1.0
            with torch.no_grad():
                full = model(input_ids=ids).logits[0, it.steer_from :]
            n = len(it.ids) - it.steer_from
            assert torch.allclose(cached[r, :n], full, atol=1e-4)
        assert not torch.allclose(cached, plain, atol=1e-3)
    assert batch.targets[1] == ([2], [18])  # gold ids[7] = 18, predicted from suffix index 2
