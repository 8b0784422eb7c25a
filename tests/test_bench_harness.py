"""``bench/harness.py``'s pieces that need no server: paired ratios and their intervals, the
engine flags both servers take, and the section writer of docs/benchmarks.md."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import harness  # noqa: E402


def test_ratio_summary_pairs_rounds_and_brackets_the_median() -> None:
    r = harness.ratio_summary([99.0, 110.0, 90.0, 100.0], [100.0, 100.0, 100.0, 100.0])
    assert r["per_round"] == pytest.approx([0.99, 1.1, 0.9, 1.0])
    assert r["median"] == pytest.approx(0.995)
    lo, hi = r["ci95"]
    assert 0.9 <= lo <= r["median"] <= hi <= 1.1
    assert harness.ratio_summary([1.0, 2.0], [1.0, 2.0])["ci95"] == [1.0, 1.0]  # no spread
    with pytest.raises(ValueError):  # rounds are paired: a missing one is an error
        harness.paired([1.0, 2.0], [1.0])


def test_geometric_interval_is_symmetric_on_the_logs() -> None:
    r = harness.geometric_ci([2.0, 0.5])
    assert r["mean"] == pytest.approx(1.0) and r["lo"] * r["hi"] == pytest.approx(1.0)
    # t with 1 degree of freedom: 12.706 x stdev(log 2, -log 2) / sqrt 2
    assert math.log(r["hi"]) == pytest.approx(12.706 * math.log(2), rel=1e-4)
    assert math.isnan(harness.geometric_ci([1.5])["lo"])


def test_engine_flags_are_one_line_for_both_servers() -> None:
    eager = harness.engine_flags("float32", 512, 8, 64 << 20)
    assert eager[-1] == "--enforce-eager" and "--served-model-name" in eager
    assert harness.engine_flags("float32", 512, 8, 64 << 20, compiled=True)[-1] == "--compile"


def test_write_docs_replaces_its_section_or_subsection_only(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Load\n\nold\n\n## Other\n\nkept\n")
    harness.write_docs("Load", "new", intro="Intro.", path=doc)
    assert doc.read_text() == "# Benchmarks\n\n## Load\n\nIntro.\n\nnew\n\n## Other\n\nkept\n"
    harness.write_docs("Chat model", "run a", "a", "One per run.", path=doc)
    harness.write_docs("Chat model", "run b", "b", "One per run.", path=doc)
    harness.write_docs("Chat model", "run a again", "a", "One per run.", path=doc)
    text = doc.read_text()
    assert text.endswith(
        "## Chat model\n\nOne per run.\n\n### a\n\nrun a again\n\n### b\n\nrun b\n"
    )
    assert "## Other\n\nkept\n" in text
