"""Artifacts on real files: round trips, every refusal with its reason, GGUF interop, the CLI."""

from __future__ import annotations

import json
import shutil
import typing
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from steerserve import artifacts as A
from steerserve.artifacts import fingerprint
from steerserve.engine.registry import tensor_sha256


def _manifest(binding: A.ModelBinding, **kw: typing.Any) -> A.Manifest:
    ivs = [
        A.Intervention(
            name="recall",
            tensor="recall",
            layer=2,
            scale=4.0,
            positions="last_prompt_and_generated",
            provenance={"fact_set": "cldr", "languages": ["en", "fr"], "seed": 0},
            calibration={
                "objective": "mean non-English accuracy",
                "chosen": {"layer": 2, "scale": 4.0},
                "table": [{"layer": 1, "scale": 2.0, "score": 0.1}],
            },
        ),
        A.Intervention(name="translation", tensor="translation", layer=1, scale=-1.5),
    ]
    return A.Manifest(name="tiny-llama", version="v1", model=binding, interventions=ivs, **kw)


def _tensors(hidden: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(hidden, generator=g) for n in ("recall", "translation")}


@pytest.fixture(scope="module")
def binding(tiny_llama: Path) -> A.ModelBinding:
    return A.binding_for_model(tiny_llama)


@pytest.fixture
def art(tmp_path: Path, binding: A.ModelBinding) -> A.Artifact:
    return A.save_artifact(
        tmp_path / "vectors" / "tiny-llama" / "v1", _manifest(binding), _tensors(64)
    )


def _edit(path: Path, fn: typing.Callable[[dict], None]) -> None:
    raw = json.loads((path / A.MANIFEST_FILE).read_text())
    fn(raw)
    (path / A.MANIFEST_FILE).write_text(json.dumps(raw))


def _retensor(path: Path, name: str, t: torch.Tensor, *, fix_sha: bool = True) -> None:
    ts = load_file(str(path / A.TENSORS_FILE))
    ts[name] = t
    save_file(ts, str(path / A.TENSORS_FILE))
    if fix_sha:
        _edit(path, lambda r: r["interventions"][0].update(sha256=tensor_sha256(t)))


def test_round_trip(art: A.Artifact, binding: A.ModelBinding, tiny_llama: Path) -> None:
    got = A.load_artifact(art.path, model_dir=tiny_llama)
    assert got.manifest == art.manifest
    assert got.manifest.model == binding
    assert set(got.tensors) == {"recall", "translation"}
    for k, t in art.tensors.items():
        assert torch.equal(got.tensors[k], t)
    iv = got.manifest.intervention("recall")
    assert iv.sha256 == tensor_sha256(t := art.tensors["recall"]) and iv.norm == pytest.approx(
        float(t.norm())
    )
    assert iv.calibration["chosen"] == {"layer": 2, "scale": 4.0}
    assert got.manifest.layer_convention == A.LAYER_CONVENTION
    assert got.manifest.vector_name(iv) == "tiny-llama/v1/recall"
    assert got.named_vectors()["tiny-llama/v1/translation"] is got.tensors["translation"]
    e = got.entries(["recall"])[0]
    assert (e.vector, e.layer, e.scale, e.positions) == (
        "tiny-llama/v1/recall",
        2,
        4.0,
        "last_prompt_and_generated",
    )


def test_save_refuses_overwrite_and_bad_sha(art: A.Artifact, binding: A.ModelBinding) -> None:
    with pytest.raises(A.ArtifactError, match="exists already"):
        A.save_artifact(art.path, art.manifest, art.tensors)
    bad = _manifest(binding)
    bad.interventions[0].sha256 = "0" * 64
    with pytest.raises(A.ArtifactError, match="sha256 mismatch with the given tensor"):
        A.save_artifact(art.path.parent / "v2", bad, _tensors(64))
    with pytest.raises(A.ArtifactError, match="tensor 'translation' not given"):
        A.save_artifact(art.path.parent / "v3", _manifest(binding), {"recall": torch.ones(64)})


def test_fingerprints_agree(tiny_models: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    prints = {}
    for arch, d in tiny_models.items():
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        fp = A.fingerprint_model(d)
        assert fp == A.fingerprint_hf_model(model)
        assert A.binding_for_hf_model(model, source=d.name) == A.binding_for_model(d)
        prints[arch] = fp
        with torch.no_grad():  # any change to the embedding slice changes the fingerprint
            w = model.get_input_embeddings().weight
            w[fingerprint._embedding_rows(w.shape[0])[5], 7] += 1e-3
        assert A.fingerprint_hf_model(model).embedding_sha256 != fp.embedding_sha256
    assert prints["llama"].config_sha256 != prints["gemma3"].config_sha256
    b = A.binding_for_model(tiny_models["gemma3"])
    assert (b.architecture, b.num_layers, b.hidden_size) == ("Gemma3ForCausalLM", 4, 64)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda r: r.update(schema_version=2),
            r"unknown schema_version 2 \(this steerserve reads 1\)",
        ),
        (lambda r: r.pop("schema_version"), "unknown schema_version None"),
        (lambda r: r.pop("model"), "malformed manifest: model: Field required"),
        (
            lambda r: r.update(color="red"),
            "malformed manifest: color: Extra inputs are not permitted",
        ),
        (
            lambda r: r["interventions"][0].update(positions="prompt"),
            "malformed manifest: interventions.0.positions: Input should be",
        ),
        (lambda r: r.update(layer_convention="input of block L"), "layer_convention must be"),
        (lambda r: r["interventions"][1].update(name="recall"), "duplicate intervention names"),
        (lambda r: r["interventions"][0].update(tensor="nope"), "tensor 'nope' missing"),
        (lambda r: r["interventions"][0].update(sha256="ab" * 32), "'recall': sha256 mismatch"),
        (lambda r: r["interventions"][0].update(norm=1.0), "norm 1.0 does not match"),
        (lambda r: r["interventions"][0].update(layer=4), "layer 4 is out of range 0..3"),
        (
            lambda r: r["interventions"][0].update(scale=None),
            "malformed manifest: interventions.0.scale: Input should be a valid number",
        ),
        (
            lambda r: r["model"].update(hidden_size=32),
            "tensor size 64 does not match hidden_size 32",
        ),
        (lambda r: r.update(languages={"xx": {"multiplier": 1}}), "languages.xx: not an ISO"),
        (lambda r: r.update(languages={"en": {"multiplier": 1}}), "languages.en: auto never"),
        (
            lambda r: r.update(languages={"fr": {"multiplier": 9}}),
            "languages.fr.multiplier: Input should be less than or equal to 8",
        ),
        (
            lambda r: r.update(languages={"fr": {"multiplier": -1}}),
            "languages.fr.multiplier: Input should be greater than or equal to 0",
        ),
        (
            lambda r: r.update(languages={"fr": {"multiplier": "NaN"}}),
            "languages.fr.multiplier",
        ),
        (
            lambda r: r["interventions"][0].update(op="rotate"),
            "interventions.0.op: Input should be 'add', 'ablate', 'replace' or 'interp'",
        ),
        (
            lambda r: r["interventions"][0].update(op="interp"),  # scale 4: not an α
            r"scale 4.0 is outside \[0, 1\] for op 'interp'",
        ),
        (
            lambda r: (
                r["interventions"][1].update(op="interp", scale=0.5),
                r.update(languages={"fr": {"multiplier": 3}}),
            ),
            r"languages.fr: multiplier 3 takes intervention 'translation' to scale 1.5, which is",
        ),
    ],
)
def test_manifest_refusals(art: A.Artifact, edit: typing.Callable, message: str) -> None:
    _edit(art.path, edit)
    with pytest.raises(A.ArtifactError, match=message):
        A.load_artifact(art.path)


def test_language_gate_of_auto(art: A.Artifact) -> None:
    """A manifest may gate ``auto`` per language; absent, every non-English language."""
    m = art.manifest
    assert m.auto_languages() is None and m.auto_multiplier("ja") == 1.0
    assert m.auto_multiplier("en") == 0.0 and m.auto_multiplier(None) == 0.0
    gated = m.model_copy(update={"languages": {"fr": A.LanguageGate(multiplier=0.5),
                                               "ko": A.LanguageGate(multiplier=0)}})  # fmt: skip
    assert gated.auto_languages() == ["fr"]
    assert (gated.auto_multiplier("fr"), gated.auto_multiplier("ko")) == (0.5, 0.0)
    assert gated.auto_multiplier("ja") == 0.0  # not listed: not steered


def test_interventions_carry_their_op(tmp_path: Path, binding: A.ModelBinding) -> None:
    """A manifest without ``op`` is all ``add`` (and is written back without it); an op is
    kept through save, load and entries, with multipliers; ablating a zero vector is refused."""
    shipped = sorted((Path(__file__).parents[2] / "vectors").glob("*/*/manifest.json"))
    assert shipped and all(
        iv.op == "add" for p in shipped for iv in A.read_manifest(p.parent).interventions
    )
    m = _manifest(binding)
    ivs = [m.interventions[0], m.interventions[1].model_copy(update={"op": "ablate"})]
    a = A.save_artifact(tmp_path / "ops", m.model_copy(update={"interventions": ivs}),
                        _tensors(64))  # fmt: skip
    raw = json.loads((a.path / A.MANIFEST_FILE).read_text())
    assert "op" not in raw["interventions"][0] and raw["interventions"][1]["op"] == "ablate"
    loaded = A.load_artifact(a.path)
    assert [(e.op, e.scale) for e in loaded.entries({"translation": 2.0})] == [("ablate", -3.0)]
    assert [e.op for e in loaded.entries()] == ["add", "ablate"]
    with pytest.raises(A.ArtifactError, match="op 'ablate' needs a non-zero vector"):
        A.save_artifact(tmp_path / "zero", m.model_copy(update={"interventions": ivs}),
                        {"recall": torch.ones(64), "translation": torch.zeros(64)})  # fmt: skip
    with pytest.raises(A.ArtifactError, match="op 'ablate' cannot be exported .*only adds"):
        A.export_gguf(loaded, tmp_path / "ops.gguf")
    A.export_gguf(loaded, tmp_path / "add.gguf", names=["recall"])  # the additive one exports


def test_language_codes_are_the_detectors() -> None:
    from lingua import Language

    assert {lang.iso_code_639_1.name.lower() for lang in Language.all()} == A.LANGUAGE_CODES


def test_tensor_refusals(art: A.Artifact) -> None:
    (art.path / A.MANIFEST_FILE).write_text("{not json")
    with pytest.raises(A.ArtifactError, match="invalid JSON"):
        A.load_artifact(art.path)
    (art.path / A.MANIFEST_FILE).write_text(art.manifest.model_dump_json())
    _retensor(art.path, "recall", torch.ones(8, 8))
    with pytest.raises(A.ArtifactError, match=r"must be 1-D, got shape \(8, 8\)"):
        A.load_artifact(art.path)
    nan = torch.ones(64)
    nan[3] = float("nan")
    _retensor(art.path, "recall", nan)
    with pytest.raises(A.ArtifactError, match="'recall': tensor contains NaN or Inf"):
        A.load_artifact(art.path)
    _retensor(art.path, "recall", torch.full((64,), float("inf")))
    with pytest.raises(A.ArtifactError, match="NaN or Inf"):
        A.load_artifact(art.path)
    _retensor(art.path, "recall", art.tensors["recall"] + 1e-3, fix_sha=False)  # tampered data
    with pytest.raises(A.ArtifactError, match="sha256 mismatch: manifest"):
        A.load_artifact(art.path)
    (art.path / A.TENSORS_FILE).unlink()
    with pytest.raises(A.ArtifactError, match="no vectors.safetensors"):
        A.load_artifact(art.path)
    with pytest.raises(A.ArtifactError, match="no manifest.json"):
        A.load_artifact(art.path.parent)


def test_wrong_model(
    art: A.Artifact, binding: A.ModelBinding, tiny_gemma: Path, tmp_path: Path
) -> None:
    with pytest.raises(
        A.ModelMismatch, match="architecture: expected 'Gemma3ForCausalLM', got 'LlamaForCausalLM'"
    ):
        A.load_artifact(art.path, model_dir=tiny_gemma)
    cases = {
        "num_layers": (
            binding.model_copy(update={"num_layers": 18}),
            "num_layers: expected 18, got 4",
        ),
        "hidden": (
            binding.model_copy(update={"hidden_size": 640}),
            "hidden_size: expected 640, got 64",
        ),
    }
    for other, msg in cases.values():
        with pytest.raises(A.ModelMismatch, match=msg):
            A.load_artifact(art.path, expect=other)
    fp = binding.fingerprint
    for key in ("config_sha256", "embedding_sha256"):
        other = binding.model_copy(update={"fingerprint": fp.model_copy(update={key: "f" * 64})})
        with pytest.raises(A.ModelMismatch, match=f"fingerprint {key}: expected ffffffff"):
            A.load_artifact(art.path, expect=other)
    other = binding.model_copy(update={"fingerprint": fp.model_copy(update={"method": "md5"})})
    with pytest.raises(A.ModelMismatch, match="fingerprint method: expected 'md5'"):
        A.load_artifact(art.path, expect=other)
    # Same shapes, different weights: only the embedding fingerprint tells them apart.
    from steerserve.models.tiny import build_tiny_model

    twin = build_tiny_model(tmp_path / "twin", "llama", seed=1)
    with pytest.raises(A.ModelMismatch, match="embedding_sha256") as ei:
        A.load_artifact(art.path, model_dir=twin)
    assert "config_sha256" not in str(ei.value)


def test_find_and_filter(
    art: A.Artifact, binding: A.ModelBinding, tiny_llama: Path, tiny_gemma: Path
) -> None:
    root = art.path.parent.parent
    other = A.binding_for_model(tiny_gemma)
    A.save_artifact(
        root / "tiny-gemma" / "v1",
        _manifest(other).model_copy(update={"name": "tiny-gemma"}),
        _tensors(64),
    )
    A.save_artifact(
        root / "tiny-llama" / "v2",
        _manifest(binding).model_copy(update={"version": "v2"}),
        _tensors(64, 1),
    )
    broken = root / "tiny-llama" / "v10"
    shutil.copytree(art.path, broken)
    _edit(broken, lambda r: r.update(schema_version=9))
    assert [p.relative_to(root).as_posix() for p in A.find_artifacts(root)] == [
        "tiny-gemma/v1",
        "tiny-llama/v1",
        "tiny-llama/v10",
        "tiny-llama/v2",
    ]
    mine = A.artifacts_for_model(root, tiny_llama)
    assert sorted(a.manifest.version for a in mine) == ["v1", "v2"]
    assert [a.manifest.name for a in A.artifacts_for_model(root, tiny_gemma)] == ["tiny-gemma"]
    assert A.resolve_artifact("tiny-llama", root) == broken  # the latest version, v10 > v2
    assert A.resolve_artifact("tiny-llama/v2", root) == root / "tiny-llama" / "v2"
    with pytest.raises(A.ArtifactError, match="no artifact 'nope'"):
        A.resolve_artifact("nope", root)
    # what the server serves by default: the newest sound version bound to the model
    assert A.preferred_artifact(root, tiny_llama).key == "tiny-llama/v2"
    assert A.preferred_artifact(root, tiny_gemma).key == "tiny-gemma/v1"
    assert A.preferred_artifact(root / "nothing", tiny_llama) is None
    assert [a.key for a in A.newest_first(mine)] == ["tiny-llama/v2", "tiny-llama/v1"]


def test_one_name_resolution() -> None:
    """Issue 19: "name or name/version, newest wins" is ``artifacts.named``, which the CLI's
    directories, the server's admin load and a request's artifact all use: digit runs compare as
    numbers, ties keep their order (the server then refuses a duplicate), a version is exact."""
    items = [("a", "v2", 0), ("a", "v10", 1), ("b", "v9", 2), ("a", "v10", 3), ("a", "v1", 4)]
    nv = lambda x: (x[0], x[1])  # noqa: E731
    assert [x[2] for x in A.named("a", items, nv)] == [1, 3, 0, 4]
    assert [x[2] for x in A.named("a/v2", items, nv)] == [0]
    assert A.named("a/", items, nv) == [] and A.named("a/v3", items, nv) == []
    assert A.named("c", items, nv) == []


def test_entries_are_the_calibrated_settings(art: A.Artifact) -> None:
    assert [(e.vector, e.layer, e.scale) for e in art.entries()] == [
        ("tiny-llama/v1/recall", 2, 4.0),
        ("tiny-llama/v1/translation", 1, -1.5),
    ]
    scaled = art.entries({"translation": 2.0})  # a mapping picks and multiplies
    assert [(e.vector, e.scale, e.positions) for e in scaled] == [
        ("tiny-llama/v1/translation", -3.0, "all")
    ]


def test_gguf_round_trip(art: A.Artifact, tiny_llama: Path, tmp_path: Path) -> None:
    import gguf

    out = A.export_gguf(art, tmp_path / "cv.gguf")
    r = gguf.GGUFReader(str(out))
    assert r.fields["general.architecture"].contents() == "controlvector"
    assert r.fields["controlvector.model_hint"].contents() == "LlamaForCausalLM"
    assert r.fields["controlvector.layer_count"].contents() == 2
    baked = {t.name: torch.from_numpy(t.data.copy()) for t in r.tensors}
    assert set(baked) == {"direction.1", "direction.2"}  # direction.N == our layer L
    assert torch.allclose(baked["direction.2"], 4.0 * art.tensors["recall"])  # scale baked in

    manifest, tensors = A.import_gguf(
        out, name="tiny-llama", version="v1-gguf", model_dir=tiny_llama
    )
    assert manifest.model == art.manifest.model
    for iv in art.manifest.interventions:
        got = manifest.intervention(iv.name)
        assert (got.layer, got.scale, got.positions) == (iv.layer, iv.scale, iv.positions)
        assert got.calibration == iv.calibration
        assert got.provenance["imported_from"] == "cv.gguf"
        assert torch.allclose(tensors[got.tensor], art.tensors[iv.tensor], rtol=1e-6, atol=0)
    saved = A.save_artifact(tmp_path / "imported", manifest, tensors)
    A.load_artifact(saved.path, model_dir=tiny_llama)


def test_gguf_shared_layer_and_subset(art: A.Artifact, tiny_llama: Path, tmp_path: Path) -> None:
    ivs = art.manifest.interventions
    both = A.Artifact(
        art.manifest.model_copy(
            update={"interventions": [ivs[0], ivs[1].model_copy(update={"layer": 2})]}
        ),
        art.tensors,
    )
    m, ts = A.import_gguf(
        A.export_gguf(both, tmp_path / "sum.gguf"), name="x", version="v1", model_dir=tiny_llama
    )
    (iv,) = m.interventions  # llama.cpp holds one direction per layer: the scaled sum
    assert (iv.name, iv.layer, iv.scale, iv.positions) == ("recall+translation", 2, 1.0, "all")
    want = 4.0 * art.tensors["recall"] - 1.5 * art.tensors["translation"]
    assert torch.allclose(ts[iv.tensor], want)
    m, _ = A.import_gguf(
        A.export_gguf(art, tmp_path / "one.gguf", names=["translation"]),
        name="x",
        version="v1",
        model_dir=tiny_llama,
    )
    assert [(iv.name, iv.layer) for iv in m.interventions] == [("translation", 1)]


def test_gguf_foreign_and_refusals(
    art: A.Artifact, tiny_llama: Path, tiny_gemma: Path, tmp_path: Path
) -> None:
    import gguf
    import numpy as np

    def write(path: Path, tensors: dict[str, np.ndarray]) -> Path:
        w = gguf.GGUFWriter(str(path), arch="controlvector")
        w.add_string("controlvector.model_hint", "llama")
        w.add_int32("controlvector.layer_count", len(tensors))
        for k, v in tensors.items():
            w.add_tensor(k, v)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    vs = {f"direction.{n}": np.full(64, n, dtype=np.float32) for n in (1, 3)}
    m, ts = A.import_gguf(
        write(tmp_path / "happy.gguf", vs),
        name="x",
        version="v1",
        model_dir=tiny_llama,
        intervention="happy",
    )
    assert [(iv.name, iv.layer, iv.scale, iv.positions) for iv in m.interventions] == [
        ("happy.L1", 1, 1.0, "all"),
        ("happy.L3", 3, 1.0, "all"),
    ]
    assert torch.equal(ts["happy.L3"], torch.full((64,), 3.0))
    assert m.intervention("happy.L1").provenance["model_hint"] == "llama"

    bad = {
        "zero": ({"direction.0": np.ones(64, np.float32)}, "not direction.N with N >= 1"),
        "range": ({"direction.4": np.ones(64, np.float32)}, "layer 4 is out of range 0..3"),
        "size": (
            {"direction.1": np.ones(32, np.float32)},
            "tensor size 32 does not match hidden_size 64",
        ),
        "f16": ({"direction.1": np.ones(64, np.float16)}, "F16, expected F32"),
        "nan": ({"direction.1": np.full(64, np.nan, np.float32)}, "NaN or Inf"),
    }
    for key, (tensors, msg) in bad.items():
        with pytest.raises(A.ArtifactError, match=msg):
            A.import_gguf(
                write(tmp_path / f"{key}.gguf", tensors),
                name="x",
                version="v1",
                model_dir=tiny_llama,
            )
    ok = A.export_gguf(art, tmp_path / "ours.gguf")
    with pytest.raises(A.ModelMismatch, match="different model"):
        A.import_gguf(ok, name="x", version="v1", model_dir=tiny_gemma)
    at0 = A.Artifact(
        art.manifest.model_copy(
            update={
                "interventions": [art.manifest.interventions[0].model_copy(update={"layer": 0})]
            }
        ),
        art.tensors,
    )
    with pytest.raises(A.ArtifactError, match="layer 0 cannot be exported"):
        A.export_gguf(at0, tmp_path / "l0.gguf")


def test_vectors_list_fits_80_columns_and_marks_the_default_and_the_gated() -> None:
    """The shipped vectors: the chat model's v1.1 is its default and gated off everywhere."""
    from steerserve.cli import app

    res = CliRunner().invoke(app, ["vectors", "list"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert max(map(len, lines)) <= 80, res.output
    [v11] = [x for x in lines if "qwen2.5-coder-1.5b-instruct/v1.1" in x]
    assert v11.startswith("*") and v11.endswith("none (gated)"), res.output
    [v1] = [x for x in lines if "qwen2.5-coder-1.5b-instruct/v1 " in x]
    assert not v1.startswith("*"), res.output


def test_cli(art: A.Artifact, tiny_llama: Path, tiny_gemma: Path) -> None:
    from steerserve.cli import app

    run = CliRunner().invoke
    root = str(art.path.parent.parent)
    res = run(app, ["vectors", "list", "--root", root])
    assert res.exit_code == 0, res.output
    assert "* tiny-llama/" in res.output and "L2" in res.output

    res = run(app, ["vectors", "show", "tiny-llama", "--root", root])
    assert res.exit_code == 0, res.output
    assert "mean non-English accuracy" in res.output and "LlamaForCausalLM" in res.output

    res = run(app, ["vectors", "verify", "--root", root, "--model", str(tiny_llama)])
    assert res.exit_code == 0, res.output
    assert "OK" in res.output

    res = run(app, ["vectors", "verify", str(art.path), "--model", str(tiny_gemma)])
    assert res.exit_code == 1
    assert "different model" in res.output
    res = run(app, ["vectors", "verify", str(art.path), "--model", str(art.path)])
    assert res.exit_code == 1 and "no config.json" in res.output

    _edit(art.path, lambda r: r.update(schema_version=3))
    res = run(app, ["vectors", "verify", str(art.path)])
    assert res.exit_code == 1 and "unknown schema_version 3" in res.output
    res = run(app, ["vectors", "list", "--root", root])
    assert res.exit_code == 0 and "unknown schema_version" in res.output
