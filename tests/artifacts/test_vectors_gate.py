"""``steerserve vectors gate`` on real artifacts on disk: the copy verifies, keeps its source's
tensors and interventions, gates ``auto``; a bad gate or an existing version is refused with the
reason and nothing is written. Also: the shipped ``qwen2.5-coder-1.5b-instruct/v1.1`` is exactly
what the command makes from v1 with the committed gates file, and its ``auto`` steers nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner, Result

from steerserve import artifacts as A
from steerserve.cli import app

ROOT = Path(__file__).resolve().parents[2]
QWEN = ROOT / "vectors" / "qwen2.5-coder-1.5b-instruct"
REPORT = "docs/results/qwen2.5-coder-1.5b-instruct/remeasure/v1-test-third/report.md"
NON_EN = "zh ja ko fr es de it ru pt nl ar".split()


@pytest.fixture
def root(tmp_path: Path, tiny_llama: Path) -> Path:
    """A vectors root holding ``tiny-llama/v1`` (two interventions, no gate)."""
    g = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(64, generator=g) for n in ("recall", "translation")}
    ivs = [
        A.Intervention(
            name="recall",
            tensor="recall",
            layer=2,
            scale=4.0,
            positions="last_prompt_and_generated",
            provenance={"seed": 0},
        ),
        A.Intervention(name="translation", tensor="translation", layer=1, scale=-1.5),
    ]
    m = A.Manifest(
        name="tiny-llama",
        version="v1",
        model=A.binding_for_model(tiny_llama),
        interventions=ivs,
        description="the source",
    )
    A.save_artifact(tmp_path / "vectors" / "tiny-llama" / "v1", m, tensors)
    return tmp_path / "vectors"


def gates_file(tmp_path: Path, gates: object, raw: str | None = None) -> Path:
    f = tmp_path / "gates.json"
    f.write_text(json.dumps(gates) if raw is None else raw)
    return f


def gate(root: Path, gates: Path, src: str = "tiny-llama/v1", *more: str) -> Result:
    args = ["vectors", "gate", src, "--version", "v1.1", "--gates", str(gates)]
    return CliRunner().invoke(app, [*args, "--root", str(root), *more])


def test_the_copy_verifies_keeps_the_vectors_and_gates_auto(
    root: Path, tmp_path: Path, tiny_llama: Path
) -> None:
    confirmation = {"result": "-3.0 [-9.0, +2.0] points", "items": 42, "decision": "off"}
    off = {"fr": {"multiplier": 0, "confirmation": confirmation}, "ja": {"multiplier": 0.0}}
    res = gate(root, gates_file(tmp_path, off))
    assert res.exit_code == 0, res.output
    assert "tiny-llama/v1.1" in res.output and "auto steers: no language" in res.output
    src = A.load_artifact(root / "tiny-llama" / "v1")
    new = A.load_artifact(root / "tiny-llama" / "v1.1", model_dir=tiny_llama)
    m = new.manifest
    assert (m.name, m.version, m.description) == ("tiny-llama", "v1.1", "the source")
    assert m.model == src.manifest.model
    assert set(new.tensors) == set(src.tensors)
    assert all(torch.equal(new.tensors[k], t) for k, t in src.tensors.items())
    for a, b in zip(src.manifest.interventions, m.interventions, strict=True):
        assert b.provenance == {**a.provenance, "copied_from": "tiny-llama/v1"}
        assert b.model_dump(exclude={"provenance"}) == a.model_dump(exclude={"provenance"})
    assert m.languages is not None and sorted(m.languages) == ["fr", "ja"]
    assert m.languages["fr"].confirmation == confirmation
    assert m.auto_languages() == [] and m.auto_multiplier("fr") == 0.0
    assert src.manifest.languages is None  # the source is untouched
    # the copy is the newest version: what a server serves by default
    assert A.resolve_artifact("tiny-llama", root) == root / "tiny-llama" / "v1.1"
    res = CliRunner().invoke(app, ["vectors", "verify", "--root", str(root)])
    assert res.exit_code == 0 and res.output.count("OK") == 2, res.output
    res = CliRunner().invoke(app, ["vectors", "show", "tiny-llama", "--root", str(root)])
    assert res.exit_code == 0 and "auto steers: no language (gate: fr ×0, ja ×0)" in res.output
    res = CliRunner().invoke(app, ["vectors", "show", "tiny-llama/v1", "--root", str(root)])
    assert "auto: every non-English language" in res.output, res.output


def test_a_path_source_a_new_description_and_a_gate_that_steers(root: Path, tmp_path: Path) -> None:
    res = gate(
        root,
        gates_file(tmp_path, {"fr": {"multiplier": 2}, "ko": {"multiplier": 0}}),
        str(root / "tiny-llama" / "v1"),
        "--description",
        "v1's vectors, gated",
    )
    assert res.exit_code == 0, res.output
    m = A.load_artifact(root / "tiny-llama" / "v1.1").manifest
    assert m.description == "v1's vectors, gated"
    assert m.auto_languages() == ["fr"] and m.auto_multiplier("fr") == 2.0
    assert "auto steers: fr (gate: fr ×2, ko ×0)" in res.output


@pytest.mark.parametrize(
    ("gates", "raw", "message"),
    [
        ({"en": {"multiplier": 0}}, None, "languages.en: auto never steers English"),
        ({"xx": {"multiplier": 0}}, None, "languages.xx: not an ISO 639-1 code"),
        ({"fr": {"multiplier": 9}}, None, "languages.fr.multiplier: Input should be less"),
        ({"fr": {"multiplier": -1}}, None, "languages.fr.multiplier: Input should be greater"),
        (None, '{"fr": {"multiplier": NaN}}', "languages.fr.multiplier: Input should be less"),
        (None, '{"fr": {"multiplier": Infinity}}', "languages.fr.multiplier: Input should be less"),
        ({"fr": {}}, None, "languages.fr.multiplier: Field required"),
        ({"fr": {"multiplier": 0, "why": 1}}, None, "languages.fr.why: Extra inputs"),
        ([{"fr": 0}], None, "must be a JSON object of languages"),
        (None, "null", "must be a JSON object of languages"),
        (None, '{"fr": ', "invalid JSON"),
    ],
)
def test_a_bad_gate_is_refused_naming_the_field(
    root: Path, tmp_path: Path, gates: object, raw: str | None, message: str
) -> None:
    res = gate(root, gates_file(tmp_path, gates, raw))
    assert res.exit_code == 1, res.output
    assert message in res.output.replace("\n", " "), res.output
    assert isinstance(res.exception, SystemExit)  # a clear error, not a traceback
    assert "Traceback" not in res.output
    assert not (root / "tiny-llama" / "v1.1").exists()
    if raw is not None and ("NaN" in raw or "Infinity" in raw):  # the value, not only the bound
        assert "(got nan)" in res.output or "(got inf)" in res.output, res.output


def test_an_existing_version_or_a_missing_source_is_refused(root: Path, tmp_path: Path) -> None:
    off = gates_file(tmp_path, {"fr": {"multiplier": 0}})
    before = (root / "tiny-llama" / "v1" / A.MANIFEST_FILE).read_bytes()
    args = ["vectors", "gate", "tiny-llama/v1", "--version", "v1", "--gates", str(off)]
    res = CliRunner().invoke(app, [*args, "--root", str(root)])
    assert res.exit_code == 1 and "exists already" in res.output, res.output
    assert (root / "tiny-llama" / "v1" / A.MANIFEST_FILE).read_bytes() == before
    assert gate(root, off).exit_code == 0
    written = (root / "tiny-llama" / "v1.1" / A.MANIFEST_FILE).read_bytes()
    res = gate(root, gates_file(tmp_path, {"fr": {"multiplier": 1}}))
    assert res.exit_code == 1 and "exists already" in res.output, res.output
    assert (root / "tiny-llama" / "v1.1" / A.MANIFEST_FILE).read_bytes() == written
    res = gate(root, off, "tiny-llama/v7")
    assert res.exit_code == 1 and "no artifact 'tiny-llama/v7'" in res.output, res.output
    res = gate(root, tmp_path / "missing.json", "tiny-llama/v1", "--root", str(tmp_path / "x"))
    assert res.exit_code == 2 and "no such directory" in res.output, res.output  # a usage error


# --- the shipped default artifact of the chat model ----------------------------------------------


def test_the_shipped_gates_are_the_reports_numbers() -> None:
    """Every non-English language of the v1 re-measurement is off, each with its paired
    difference and CI as the report gives them, on its 42 items."""
    gates = json.loads((QWEN / "gates-v1.1.json").read_text())
    report = json.loads((ROOT / REPORT).with_suffix(".json").read_text())
    per = report["arms"]["both"]["per_language"]
    assert sorted(gates) == sorted(NON_EN) and sorted(per) == sorted([*NON_EN, "en"])

    def pts(x: float) -> str:
        s = f"{100 * x:+.1f}"
        return "+0.0" if s == "-0.0" else s

    for lang, g in gates.items():
        d = per[lang]["vs_unsteered"]
        lo, hi = d["ci95"]
        assert g["multiplier"] == 0
        assert g["confirmation"] == {
            "result": f"{pts(d['diff'])} [{pts(lo)}, {pts(hi)}] points, paired, v1 vs unsteered",
            "items": per[lang]["n"],
            "source": REPORT,
            "decision": "off: no gain beyond the CI",
        }
        assert per[lang]["n"] == 42 and lo <= 0  # no language gains beyond its CI


def test_the_shipped_v1_1_is_v1_gated_by_the_command(tmp_path: Path) -> None:
    """Remaking v1.1 from v1 with the committed gates file gives the shipped v1.1 (but its
    date); it is the newest version, and its ``auto`` steers no language while ``true`` still
    applies v1's interventions."""
    from steerserve.engine.registry import VectorRegistry
    from steerserve.server.generate.policy import SteeringPolicy
    from steerserve.server.steering import Auto, On

    root = tmp_path / "vectors"
    shutil.copytree(QWEN / "v1", root / QWEN.name / "v1")
    res = gate(root, QWEN / "gates-v1.1.json", f"{QWEN.name}/v1")
    assert res.exit_code == 0, res.output
    remade = A.load_artifact(root / QWEN.name / "v1.1")
    shipped = A.load_artifact(QWEN / "v1.1")
    assert remade.manifest.model_dump(exclude={"created", "description"}) == (
        shipped.manifest.model_dump(exclude={"created", "description"})
    )
    assert "v1's vectors, gated" in shipped.manifest.description
    assert all(torch.equal(shipped.tensors[k], t) for k, t in remade.tensors.items())
    v1 = A.load_artifact(QWEN / "v1")
    assert A.resolve_artifact(QWEN.name, QWEN.parent) == QWEN / "v1.1"
    assert shipped.manifest.auto_languages() == []

    reg = VectorRegistry()
    for name, t in shipped.named_vectors().items():
        reg.add(name, t)
    pol = SteeringPolicy(reg, default="auto")
    pol.add(shipped)
    for lang in sorted(A.LANGUAGE_CODES - {"en"}):
        d = pol.resolve(Auto(), language=lang)
        assert d.entries == () and d.auto_languages == (), lang
    assert pol.resolve(Auto(), language="en").entries == ()
    on = pol.resolve(On(), language="ja")
    want = [(iv.layer, iv.scale, iv.positions) for iv in v1.manifest.interventions]
    assert [(e.layer, e.scale, e.positions) for e in on.entries] == want
    assert [e.vector for e in on.entries] == [
        f"{QWEN.name}/v1.1/{iv.name}" for iv in v1.manifest.interventions
    ]
