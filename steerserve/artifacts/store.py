"""Artifacts on disk: ``vectors/<model-slug>/<version>/manifest.json`` +
``vectors.safetensors``, verified on load, saved, scanned and found by name."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from steerserve.artifacts.fingerprint import binding_for_model, check_binding, embedding_norm
from steerserve.artifacts.manifest import (
    MANIFEST_FILE,
    TENSORS_FILE,
    Artifact,
    ArtifactError,
    Manifest,
    ModelBinding,
    ModelMismatch,
    read_manifest,
)
from steerserve.engine.ops import OPS
from steerserve.engine.registry import tensor_sha256

log = logging.getLogger(__name__)
R = TypeVar("R")  # what a name resolves among: artifacts, scanned folders, directories


# --- verification, load, save ------------------------------------------------------------------


def _check(manifest: Manifest, tensors: Mapping[str, torch.Tensor], where: str) -> None:
    m = manifest.model
    for iv in manifest.interventions:
        f = f"{where}: intervention {iv.name!r}"
        if iv.tensor not in tensors:
            raise ArtifactError(f"{f}: tensor {iv.tensor!r} missing from {TENSORS_FILE}")
        t = tensors[iv.tensor]
        if t.dim() != 1:
            raise ArtifactError(f"{f}: tensor must be 1-D, got shape {tuple(t.shape)}")
        if t.numel() != m.hidden_size:
            raise ArtifactError(
                f"{f}: tensor size {t.numel()} does not match hidden_size {m.hidden_size}"
            )
        if not bool(torch.isfinite(t).all()):
            raise ArtifactError(f"{f}: tensor contains NaN or Inf")
        if not iv.sha256:
            raise ArtifactError(f"{f}: sha256 missing")
        digest = tensor_sha256(t)
        if digest != iv.sha256:
            raise ArtifactError(
                f"{f}: sha256 mismatch: manifest {iv.sha256[:16]}…, data {digest[:16]}…"
            )
        norm = float(t.float().norm())
        if norm == 0 and OPS[iv.op].needs_direction:
            raise ArtifactError(f"{f}: op {iv.op!r} needs a non-zero vector")
        if iv.norm is None or not math.isclose(iv.norm, norm, rel_tol=1e-4, abs_tol=1e-6):
            raise ArtifactError(f"{f}: norm {iv.norm} does not match the data's {norm:.6g}")
        if not 0 <= iv.layer < m.num_layers:
            raise ArtifactError(
                f"{f}: layer {iv.layer} is out of range 0..{m.num_layers - 1} for a "
                f"{m.num_layers}-layer model"
            )


def _read_tensors(tf: Path, manifest: Manifest, where: str) -> dict[str, torch.Tensor]:
    """The tensors the manifest names, each read only once its header says it is the model's
    hidden size (1-D): a file with a huge or mis-shaped tensor, or tensors nobody names, costs
    no more memory than the vectors themselves."""
    from safetensors import safe_open

    hidden = manifest.model.hidden_size
    out: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(tf), framework="pt") as f:
            names = set(f.keys())
            for iv in manifest.interventions:
                if iv.tensor not in names or iv.tensor in out:
                    continue  # missing: _check names it
                shape = f.get_slice(iv.tensor).get_shape()
                f_iv = f"{where}: intervention {iv.name!r}"
                if len(shape) != 1:
                    raise ArtifactError(f"{f_iv}: tensor must be 1-D, got shape {tuple(shape)}")
                if shape[0] != hidden:
                    raise ArtifactError(
                        f"{f_iv}: tensor size {shape[0]} does not match hidden_size {hidden}"
                    )
                out[iv.tensor] = f.get_tensor(iv.tensor)
    except ArtifactError:
        raise
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise ArtifactError(f"{tf}: unreadable: {e}") from None
    return out


def load_artifact(
    path: str | Path,
    *,
    model_dir: str | Path | None = None,
    expect: ModelBinding | None = None,
) -> Artifact:
    """Load and verify an artifact; with ``model_dir``/``expect`` also check it fits that model."""
    path = Path(path)
    manifest = read_manifest(path)
    tf = path / TENSORS_FILE
    if not tf.is_file():
        raise ArtifactError(f"{path}: no {TENSORS_FILE}")
    tensors = _read_tensors(tf, manifest, str(path))
    _check(manifest, tensors, str(path))
    if expect is None and model_dir is not None:
        expect = binding_for_model(model_dir)
    if expect is not None:
        check_binding(expect, manifest.model, f"{manifest.name}/{manifest.version}")
    return Artifact(manifest, tensors, path)


def prepared(
    manifest: Manifest, tensors: Mapping[str, torch.Tensor]
) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """Tensors as contiguous float32 and the manifest with sha256/norm filled in (and checked)."""
    ts = {
        k: torch.as_tensor(v).detach().to(torch.float32).cpu().contiguous().clone()
        for k, v in tensors.items()
    }
    ivs = []
    for iv in manifest.interventions:
        t = ts.get(iv.tensor)
        if t is None:
            raise ArtifactError(f"intervention {iv.name!r}: tensor {iv.tensor!r} not given")
        digest = tensor_sha256(t)
        if iv.sha256 and iv.sha256 != digest:
            raise ArtifactError(f"intervention {iv.name!r}: sha256 mismatch with the given tensor")
        ivs.append(iv.model_copy(update={"sha256": digest, "norm": float(t.norm())}))
    out = manifest.model_copy(update={"interventions": ivs})
    _check(out, ts, f"{out.name}/{out.version}")
    return out, ts


def save_artifact(
    path: str | Path,
    manifest: Manifest,
    tensors: Mapping[str, torch.Tensor],
    *,
    overwrite: bool = False,
) -> Artifact:
    """Write ``manifest.json`` + ``vectors.safetensors``; a published version is immutable."""
    from safetensors.torch import save_file

    path = Path(path)
    if (path / MANIFEST_FILE).exists() and not overwrite:
        raise ArtifactError(f"{path}: an artifact exists already (pass overwrite=True)")
    manifest, ts = prepared(manifest, tensors)
    path.mkdir(parents=True, exist_ok=True)
    tmp_t, tmp_m = path / f".{TENSORS_FILE}.tmp", path / f".{MANIFEST_FILE}.tmp"
    save_file(ts, str(tmp_t), metadata={"steerserve": f"{manifest.name}/{manifest.version}"})
    tmp_m.write_text(manifest.model_dump_json(indent=2) + "\n")
    os.replace(tmp_t, path / TENSORS_FILE)
    os.replace(tmp_m, path / MANIFEST_FILE)
    return Artifact(manifest, ts, path)


def find_artifacts(root: str | Path) -> list[Path]:
    """Every directory under ``root`` (itself included) holding a manifest. Linked folders are
    followed (a version folder may be a link), each real folder listed once, link loops cut."""
    root = Path(root)
    if not root.is_dir():
        return []
    found: dict[str, Path] = {}
    seen: set[str] = set()
    for here, dirs, files in os.walk(root, followlinks=True):
        real = os.path.realpath(here)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        dirs.sort()
        if MANIFEST_FILE in files:
            found.setdefault(real, Path(here))
    return sorted(found.values())


def outside(path: Path, root: str | Path) -> str | None:
    """Why the artifact at ``path`` reaches out of ``root`` through a link (its folder or one of
    its files), or None: a server serves what its vectors directory holds, nothing else."""
    top = Path(os.path.realpath(root))
    for p in (path, path / MANIFEST_FILE, path / TENSORS_FILE):
        if p.exists() and not Path(os.path.realpath(p)).is_relative_to(top):
            return f"{p.name} links outside the vectors directory"
    return None


@dataclass(frozen=True)
class Scanned:
    """One artifact directory as found under a root: loaded and verified for the model, or the
    reason it was refused (``other_model``: it is bound to another model)."""

    path: Path
    name: str
    version: str
    artifact: Artifact | None = None
    refused: str | None = None
    other_model: bool = False
    embedding_norm: float | None = None  # the model's (:func:`embedding_norm`), for vetting


def scan_artifacts(
    root: str | Path, model_dir: str | Path, names: Collection[str] | None = None
) -> list[Scanned]:
    """Every artifact directory under ``root``, loaded and verified for this model (name and
    version from its manifest, or from its path when the manifest is unreadable). ``names``:
    only the artifacts of these names are loaded and listed (a hot-load verifies the versions
    of the one it loads, not every tensor in the folder: that took 28 s under load)."""
    expect = binding_for_model(model_dir)
    reference = embedding_norm(model_dir)
    out = []
    for p in find_artifacts(root):
        rel = p.relative_to(root).parts if p != Path(root) else ()
        name, version = (rel[-2], rel[-1]) if len(rel) >= 2 else ("", rel[-1] if rel else "")
        if (why := outside(p, root)) is not None:
            out.append(Scanned(p, name, version, refused=why))
            continue
        if names is not None:
            with contextlib.suppress(ArtifactError):
                name = read_manifest(p).name  # the manifest only: no tensor read
            if name not in names:
                continue
        try:
            art = load_artifact(p, expect=expect)
            meta = art.manifest
            out.append(Scanned(p, meta.name, meta.version, art, embedding_norm=reference))
            continue
        except ModelMismatch as e:
            refused, other = str(e), True
        except ArtifactError as e:
            refused, other = str(e), False
        try:
            m = read_manifest(p)
            name, version = m.name, m.version
        except ArtifactError:
            pass
        out.append(Scanned(p, name, version, refused=refused, other_model=other))
    return out


def artifacts_for_model(root: str | Path, model_dir: str | Path) -> list[Artifact]:
    """The verified artifacts under ``root`` bound to this model; others are skipped and logged."""
    out = []
    for s in scan_artifacts(root, model_dir):
        if s.artifact is not None:
            out.append(s.artifact)
        else:
            (log.info if s.other_model else log.warning)("skipping %s: %s", s.path, s.refused)
    return out


def version_key(v: str) -> list[Any]:
    """Sort key of versions: digit runs compare as numbers (``v10`` after ``v9``)."""
    return [(0, int(s), "") if s.isdigit() else (1, 0, s) for s in re.split(r"(\d+)", v) if s]


def named(ref: str, items: Iterable[R], name_version: Callable[[R], tuple[str, str]]) -> list[R]:
    """The items ``ref`` names, newest version first (ties in their given order): ``name/version``
    exactly, or every version of ``name``. The one rule of "name or name/version, newest wins",
    for the CLI's artifact directories, the server's loads by name and a request's artifact."""
    name, slash, version = ref.partition("/")
    hits = [
        x
        for x in items
        if name_version(x)[0] == name and (not slash or name_version(x)[1] == version)
    ]
    return _newest_version_first(hits, name_version)


def _newest_version_first(
    items: Iterable[R], name_version: Callable[[R], tuple[str, str]]
) -> list[R]:
    """Newest version first by :func:`version_key`; a stable sort keeps ties in their order."""
    return sorted(items, key=lambda x: version_key(name_version(x)[1]), reverse=True)


def artifact_name_version(a: Artifact) -> tuple[str, str]:
    """An artifact's ``(name, version)``: what :func:`named` resolves a reference against."""
    return a.manifest.name, a.manifest.version


def newest_first(
    arts: Iterable[R],
    name_version: Callable[[R], tuple[str, str]] = artifact_name_version,  # type: ignore[assignment]
) -> list[R]:
    """By name, each name's newest version first: the order a server loads artifacts in, so the
    first is the one it serves by default (``vectors list`` marks it from manifests alone)."""
    newest = _newest_version_first(arts, name_version)
    return sorted(newest, key=lambda a: name_version(a)[0])


def default_vectors_dir() -> str:
    """Where the server, eval and analyze look for artifacts when not told: the shipped vectors
    of an installed package (``steerserve/vectors``, package data of the wheel: setup.py), else
    ``vectors/`` of the source tree (an editable install), else ./vectors."""
    package = Path(__file__).resolve().parents[1]  # steerserve/
    for here in (package / "vectors", package.parent / "vectors"):
        if here.is_dir():
            return str(here)
    return "vectors"


def preferred_artifact(root: str | Path | None, model_dir: str | Path) -> Artifact | None:
    """The artifact ``steering: "auto"`` serves for this model from ``root``: the first of
    :func:`newest_first` among the verified ones bound to it (None when there is none)."""
    if root is None or not Path(root).is_dir():
        return None
    arts = newest_first(artifacts_for_model(root, model_dir))
    return arts[0] if arts else None


def resolve_artifact(ref: str, root: str | Path = "vectors") -> Path:
    """``NAME/VERSION`` or ``NAME`` (its latest version) under ``root``, or an artifact dir."""
    if (Path(ref) / MANIFEST_FILE).is_file():
        return Path(ref)
    base = Path(root) / ref
    if (base / MANIFEST_FILE).is_file():
        return base
    dirs = [p for p in base.iterdir() if (p / MANIFEST_FILE).is_file()] if base.is_dir() else []
    versions = named(base.name, dirs, lambda p: (base.name, p.name))  # every version, newest first
    if not versions:
        raise ArtifactError(
            f"no artifact {ref!r} under {str(root)!r}: give the artifact's folder as a path "
            "(as tune --out wrote it), or the folder holding it as --root"
        )
    return versions[0]
