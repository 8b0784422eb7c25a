"""The oracle on the tiny random Gemma 3: replacing a state by itself changes nothing, both
pivots run, and a rerun reads every kept piece back."""

from __future__ import annotations

from pathlib import Path

import pytest

from steerserve.research.conditions import fact_index
from steerserve.research.experiments.oracle import oracle
from steerserve.research.facts import eval_records
from steerserve.research.runner import Runner

pytestmark = pytest.mark.usefixtures("one_thread")


def test_oracle_pivots_sanity_and_resume(runner: Runner, tmp_path: Path) -> None:
    items = eval_records("calib", langs=["en", "zh", "ja"], limit_per_lang=1)
    facts = fact_index("calib")
    kw = dict(per_relation=1, layers=[0, 3], pivots=("en", "zh"), partial=tmp_path, group=1)
    out = oracle(runner, items, facts, **kw)
    assert out["pivots"]["en"]["n_items"] == 2 and out["pivots"]["zh"]["n_items"] == 1
    for pv, sfx in (("en", ""), ("zh", ".zh")):
        e = out["pivots"][pv]["edits"]
        assert e[f"self{sfx}@2"]["logp"]["diff_non_en"]["diff"] == pytest.approx(0, abs=1e-4)
        assert {f"replace_fact{sfx}@3", f"add_rel{sfx}@0"} <= set(e)
    # a rerun reads every piece back instead of running the model
    broken = Runner.__new__(Runner)
    broken.num_layers, broken.model, broken.tok = runner.num_layers, None, None
    again = oracle(broken, items, facts, **kw)
    assert again["pivots"] == out["pivots"]


def test_oracle_at_the_answer_position(runner: Runner, tmp_path: Path) -> None:
    """Chat items patched where the name starts: each item gets its own prefix, the relation
    means are taken there too, and self-patching still changes nothing."""
    items = eval_records("calib", langs=["en", "ja"], limit_per_lang=2, form="chat")
    kw = dict(per_relation=1, layers=[1], pivots=("en",), partial=tmp_path, group=1)
    out = oracle(runner, items, fact_index("calib"), answer_position=True, **kw)
    assert out["position"] == "name onset (own prefix)" and out["pivots"]["en"]["n_items"] == 2
    e = out["pivots"]["en"]["edits"]
    assert e["self@2"]["logp"]["diff_non_en"]["diff"] == pytest.approx(0, abs=1e-4)
    kept = (tmp_path / "prefixed.json").read_text()
    assert '"prefix_source"' in kept
