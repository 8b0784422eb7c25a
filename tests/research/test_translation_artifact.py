"""``steerserve translation-vector`` (research/translation_artifact.py) on the tiny Gemma: the
artifact docs/results/qwen2.5-coder-1.5b-instruct/v2 was built as, by a command."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from typer.testing import CliRunner

from steerserve.artifacts import load_artifact
from steerserve.cli import app


def test_cli_builds_the_translation_vector(tiny_gemma: Path, tmp_path: Path) -> None:
    """The vector is convert0 - zero of the kept means at the block, the setting and the
    calibration record are the manifest's, and a second build reuses the kept means."""
    out, means = tmp_path / "vec" / "tiny" / "v2", tmp_path / "means.pt"
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"objective": "test", "holdout": {"confirms": False}}))
    args = [
        "lab",
        "translation-vector",
        "--model",
        str(tiny_gemma),
        "--out",
        str(out),
        "--layer",
        "2",
    ]
    args += ["--scale", "0.5", "--langs", "ja,ko", "--form", "chat", "--means", str(means)]
    args += ["--calibration", str(cal), "--threads", "1"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    art = load_artifact(out, model_dir=tiny_gemma)
    [iv] = art.manifest.interventions
    assert (iv.name, iv.layer, iv.scale, iv.positions) == (
        "translation", 2, 0.5, "last_prompt_and_generated"
    )  # fmt: skip
    assert art.manifest.name == tiny_gemma.name and art.manifest.version == "v2"
    assert iv.calibration == {"objective": "test", "holdout": {"confirms": False}}
    assert "pooled over ja/ko" in iv.provenance["construction"]
    m = torch.load(means, weights_only=False)
    want = (m["convert0"] - m["zero"])[2]
    assert torch.equal(art.named_vectors()[art.manifest.vector_name(iv)], want)
    again = CliRunner().invoke(app, args)  # exists: refused without --overwrite
    assert again.exit_code == 1 and "error:" in again.output
    again = CliRunner().invoke(app, [*args, "--overwrite"])  # the kept means: the same vector
    assert again.exit_code == 0, again.output
    assert load_artifact(out).manifest.interventions[0].sha256 == iv.sha256
    bad = CliRunner().invoke(app, [*args[:7], "99", "--out", str(tmp_path / "x" / "v1")])
    assert bad.exit_code == 2 and "--layer" in bad.output
