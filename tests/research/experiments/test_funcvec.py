"""Step 3d's function vectors on a tiny random Gemma 3: head patching is exact (a head patched
with its own input changes nothing), head outputs add up to o_proj's, the corrupted prompt only
moves the answers, and the experiment runs end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from steerserve.research.conditions import fact_index, form_prompt
from steerserve.research.experiments.funcvec import (
    HeadHooks,
    corrupted_prompt,
    function_vectors,
    funcvec_md,
    head_effects,
    head_outputs,
    o_projs,
)
from steerserve.research.facts import eval_records, load_facts, prompt, query
from steerserve.research.runner import Runner

pytestmark = pytest.mark.usefixtures("one_thread")


def _records(n: int) -> list[dict]:
    facts = load_facts("train", ["fr", "ja"])[:n]
    return [{"lang": f.lang, "answers": list(f.answers), "prompt": prompt(f, 2)} for f in facts]


def test_patching_a_head_with_its_own_input_changes_nothing(runner: Runner) -> None:
    recs = _records(4)
    # capture every head's own last-token input (the records' full forwards)
    from steerserve.research.extract import encode
    from steerserve.research.hf import left_padded

    hooks = HeadHooks(runner.model)
    b = left_padded([encode(runner.tok, r["prompt"]) for r in recs], runner.pad)
    with torch.no_grad(), hooks.active():
        hooks.capture = [None] * len(hooks.projs)
        runner.decoder(**b.inputs(runner.dev), use_cache=False)
        own = torch.stack(hooks.capture, 1)  # type: ignore[arg-type]
    out = head_effects(runner, recs, own, batch_size=3)
    d = out["patched"] - out["base"][:, None, None]
    assert torch.isfinite(d).all() and d.abs().max() < 1e-5
    # a different value does change the answer's probability
    other = head_effects(runner, recs, torch.randn_like(own[0]) * 10, batch_size=3, heads=[(0, 0)])
    assert (other["patched"][:, 0, 0] - other["base"]).abs().max() > 1e-4


def test_head_outputs_add_up_to_o_proj(runner: Runner) -> None:
    proj = o_projs(runner.model)[1]
    n, hd = HeadHooks(runner.model).n_heads, HeadHooks(runner.model).head_dim
    z = torch.randn(3, n, hd)
    total = head_outputs(proj, z).sum(-2)
    if proj.bias is not None:
        total = total + proj.bias
    with torch.no_grad():
        ref = proj(z.reshape(3, n * hd))
    assert torch.allclose(total, ref, atol=1e-5)


@pytest.mark.parametrize("form", ["completion", "chat"])
def test_corrupted_prompt_permutes_only_the_answers(form: str) -> None:
    fact = load_facts("calib", ["ja"])[0]
    clean, bad = form_prompt(fact, "native5", form), corrupted_prompt(fact, form)
    if form == "chat":
        assert [m["role"] for m in bad] == [m["role"] for m in clean]
        assert [m for m in bad if m["role"] != "assistant"] == [
            m for m in clean if m["role"] != "assistant"
        ]  # system, demonstration questions and the query unchanged
        a, b = ([m["content"] for m in x if m["role"] == "assistant"] for x in (clean, bad))
    else:
        assert bad.endswith(query(fact)) and clean.endswith(query(fact))
        cl, bl = clean.split("\n"), bad.split("\n")
        assert len(cl) == len(bl) == 6 and cl[-1] == bl[-1] == query(fact)
        qs = [line.split("：")[:-1] for line in cl[:-1]]  # ja: "国：X。首都：<answer>"
        assert qs == [line.split("：")[:-1] for line in bl[:-1]]
        a, b = ([line.split("：")[-1] for line in x[:-1]] for x in (cl, bl))
    assert sorted(a) == sorted(b) and len(a) == 5
    assert all(x != y for x, y in zip(a, b, strict=True))  # every demonstration's answer moved


def test_funcvec_runs_end_to_end(runner: Runner, tmp_path: Path) -> None:
    facts = fact_index("calib")
    items = eval_records("calib", langs=["en", "fr", "ja"], limit_per_lang=4)
    sel, conf = items[::2], items[1::2]
    kw = {"layers": [1, 2], "scales": [1.0, 4.0], "heads": 3, "n_prompts": 3, "n_mean": 4}
    out = function_vectors(runner, sel, conf, facts, **kw, top=2, partial=tmp_path)
    assert len(out["heads"]) == 3 and out["n_mean"] == 4 and out["n_prompts"] == 3
    aies = [h["aie"] for h in out["heads"]]
    assert aies == sorted(aies, reverse=True) and out["fv_norm"] > 0
    f = out["forms"]["zero"]
    assert len(f["selection"]) == 4 and len(f["chosen"]) == 2
    assert set(f["confirmation"]) == set(f["chosen"]) and f["n_confirm"] == len(conf)
    for row in f["confirmation"].values():
        assert "diff_non_en" in row["logp"]
    assert (tmp_path / "head_means.pt").is_file() and (tmp_path / "aie.json").is_file()
    md = "\n".join(funcvec_md(out))
    assert "| 1 |" in md and "Confirmation on" in md
    # resumable: the kept pieces give the same result
    again = function_vectors(runner, sel, conf, facts, **kw, top=2, partial=tmp_path)
    assert again["heads"] == out["heads"] and again["forms"] == out["forms"]
