"""The ceilings command line on the tiny random Gemma 3: an experiment added through the registry
runs end to end, and a registered one run through ``python -m`` merges its section into a
folder that holds only an earlier run's summary."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from steerserve.research import ceilings
from steerserve.research.experiments.base import Context, Experiment, Plan
from steerserve.research.experiments.registry import EXPERIMENTS, register
from steerserve.research.runner import Edit
from steerserve.research.scoring import compact, summarise

pytestmark = pytest.mark.usefixtures("one_thread")


def _toy_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--toy-scale", type=float, default=1.0, help="the toy edit's scale")


def _toy_plan(ctx: Context) -> Plan:
    items = ctx.records((0, 20))
    return Plan("toy", f"{len(items)} items.", {"items": items})


def _toy_run(ctx: Context, plan: Plan) -> dict[str, Any]:
    """One random direction added at block 1 against no edit: the smallest real experiment."""
    items = plan.inputs["items"]
    h = ctx.runner.model.config.get_text_config().hidden_size
    vec = torch.randn(h, generator=torch.Generator().manual_seed(0))
    edit = Edit.of(
        "rand@1", 1, "add", vec, ctx.args.toy_scale, positions="last_prompt_and_generated"
    )
    res, _ = ctx.runner.run(items, [None, edit], progress=False)
    return {"rand@1": compact(summarise(items, res[1], res[0])), "n": len(items)}


def _toy_report(exp: Mapping[str, Any]) -> list[str]:
    return [f"| rand@1 | {exp['rand@1']['d_logp']:+.3f} | {exp['n']} items |"]


def test_a_toy_experiment_added_through_the_registry_runs_end_to_end(
    tiny_gemma: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    toy = Experiment("toy", "A toy: one random direction", _toy_plan, _toy_run, _toy_report,
                     (_toy_options,))  # fmt: skip
    monkeypatch.setitem(EXPERIMENTS, "toy", toy)  # what register() does, undone after the test
    assert register(toy) is toy
    ceilings.main(["--model", str(tiny_gemma), "--out", str(tmp_path), "--experiments", "toy",
                   "--langs", "fr", "--threads", "1", "--batch-size", "4", "--toy-scale", "2"])  # fmt: skip
    md = (tmp_path / "report.md").read_text()
    assert "## A toy: one random direction" in md and "| rand@1 |" in md
    assert "--toy-scale 2" in md  # the command as run heads the report
    exp = json.loads((tmp_path / "summary.json").read_text())["experiments"]["toy"]
    assert exp["n"] >= 2 and exp["setup"].startswith(f"{exp['n']} items.")


def test_funcvec_cli_writes_its_section(tiny_gemma: Path, tmp_path: Path) -> None:
    """Through ``python -m`` on purpose, as the commands in docs/results are recorded. The folder holds only an earlier run's committed ``summary.json`` (as a fresh checkout
    does: report.json is not committed): its experiment must stay in the report."""
    import json

    earlier = {"command": "python -m steerserve.research.ceilings --experiments taskvec",
               "setup": "an earlier run", "means_seconds": 0.0, "forms": {}}  # fmt: skip
    (tmp_path / "summary.json").write_text(
        json.dumps({"model": "m", "form": "completion", "experiments": {"taskvec": earlier}})
    )

    args = ["--model", str(tiny_gemma), "--out", str(tmp_path), "--experiments", "funcvec",
            "--langs", "fr", "--select-part", "0/20", "--confirm-part", "1/20", "--threads", "1",
            "--fv-layers", "1", "--fv-scales", "2", "--fv-heads", "2", "--fv-prompts", "3",
            "--top", "1"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, "-m", "steerserve.research.ceilings", *args], check=True, env=env
    )
    md = (tmp_path / "report.md").read_text()
    assert "## Step 3d: function vector (Todd et al.), top heads by indirect effect" in md
    assert "| fv2x2@1 |" in md and "Confirmation on" in md
    assert "## Step 3a: recall task vector" in md and "an earlier run" in md
    assert set(json.loads((tmp_path / "summary.json").read_text())["experiments"]) == {
        "taskvec",
        "funcvec",
    }
