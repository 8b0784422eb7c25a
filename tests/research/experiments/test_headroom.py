"""Headroom on the tiny random Gemma 3: limited conditions pair on the same items, kept pieces
are reused or refused, and the report keeps the per-item results out of summary.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from steerserve.research.conditions import fact_index
from steerserve.research.experiments.headroom import headroom, headroom_md
from steerserve.research.experiments.report import write_report
from steerserve.research.facts import eval_records
from steerserve.research.runner import Runner

pytestmark = pytest.mark.usefixtures("one_thread")


def test_headroom_limits_pair_on_the_same_items(runner: Runner, tmp_path: Path) -> None:
    items = eval_records("calib", langs=["en", "zh", "ja"], limit_per_lang=2, form="chat")
    out = headroom(runner, items, fact_index("calib"), 0, tmp_path, {"native5": 1})
    n = out["n_items"]
    assert n["eval"] == n["convert"] == n["english"] == n["chinese"] == 6 and n["native5"] == 3
    assert out["ids"]["native5"] == [items[i]["id"] for i in (0, 2, 4)]
    assert (
        out["conditions"]["english"]["correct"]["per_lang"]["ja"]
        == (out["conditions"]["eval"]["correct"]["per_lang"]["en"])
    )  # the English twin's answers
    assert {"known_zh", "wrong_but_known_zh"} <= set(out["shares"])
    assert "| (vii) same fact asked in Chinese" in "\n".join(headroom_md(out))
    assert sorted(p.name for p in tmp_path.glob("*.json")) == [
        "convert.json", "eval.json", "mixed5.json", "native5.json", "seconds.json",
    ]  # fmt: skip
    # a rerun with a limit reuses a piece kept from an unlimited run on all its items, and
    # refuses one that belongs to other items (never pairs results with the wrong facts)
    broken = Runner.__new__(Runner)
    broken.num_layers, broken.model, broken.tok = runner.num_layers, None, None
    again = headroom(broken, items, fact_index("calib"), 0, tmp_path, {"native5": 1, "mixed5": 1})
    assert again["n_items"]["mixed5"] == 6 and again["n_items"]["native5"] == 3
    assert again["conditions"]["mixed5"] == out["conditions"]["mixed5"]
    with pytest.raises(ValueError, match="native5.json holds 3 results, not 6"):
        headroom(broken, items, fact_index("calib"), 0, tmp_path, {"native5": 2})  # 2 = all items
    # the report: per-language log P, and a small summary.json without the per-item results
    rep = {"model": "tiny", "experiments": {"headroom@0of1": {**out, "command": "c", "setup": ""}}}
    write_report(rep, tmp_path / "rep")
    assert (
        "Mean teacher-forced log P(gold) per language" in (tmp_path / "rep/report.md").read_text()
    )
    summ = json.loads((tmp_path / "rep/summary.json").read_text())["experiments"]["headroom@0of1"]
    assert "items" not in summ and "ids" not in summ and summ["conditions"] == out["conditions"]
