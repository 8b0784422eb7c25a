"""Steering-vector artifacts: a manifest bound to one model, verified tensors, GGUF interop.

Layout: ``vectors/<model-slug>/<version>/manifest.json`` + ``vectors.safetensors``. An off-by-one
layer or a vector from another model silently weakens steering, so loading checks everything and
refuses with the reason (:class:`ArtifactError`) instead of serving a wrong vector.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import logging
import math
import os
import re
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from steerserve import __version__
from steerserve.engine.ops import DEFAULT_OP, OPS
from steerserve.engine.registry import tensor_sha256
from steerserve.engine.spec import POSITIONS, SteeringEntry

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
LAYER_CONVENTION = "output of decoder block L (0-based) = transformers hidden_states[L+1]"
MANIFEST_FILE = "manifest.json"
TENSORS_FILE = "vectors.safetensors"
R = TypeVar("R")  # what a name resolves among: artifacts, scanned folders, directories
EMBED_ROWS, EMBED_COLS = 64, 256
FINGERPRINT_METHOD = (
    "steerserve-fp-v1: sha256 of canonical JSON of the config's shape keys; "
    f"sha256 of float32 embed_tokens.weight[rows i*vocab//{EMBED_ROWS} for i<{EMBED_ROWS}, "
    f"cols 0:{EMBED_COLS}]"
)
_SHAPE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)
SLUG = r"^[A-Za-z0-9][A-Za-z0-9_.:@+-]{0,99}$"  # a path segment of an engine vector name
Positions = Literal[tuple(POSITIONS)]  # type: ignore[valid-type]  # the engine's, by name
OpName = Literal[tuple(OPS)]  # type: ignore[valid-type]  # the rows of engine/ops.py


class ArtifactError(ValueError):
    """An artifact that must not be used; the message names the reason."""


class ModelMismatch(ArtifactError):
    """A sound artifact made for another model (expected when several models share a root)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Fingerprint(_Strict):
    config_sha256: str
    embedding_sha256: str
    method: str = FINGERPRINT_METHOD


class ModelBinding(_Strict):
    """The model an artifact was computed on; vectors are only meaningful there."""

    architecture: str
    num_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    fingerprint: Fingerprint
    source: str = ""


class Intervention(_Strict):
    """One vector with its recommended use: ``op`` (default: add ``scale * v``) at the output of
    block ``layer``. ``op`` is written only when it is not ``add``, so a manifest of additive
    interventions reads as it did before operations existed (and older readers still load it)."""

    name: str = Field(pattern=SLUG)
    tensor: str = Field(min_length=1)
    layer: int = Field(ge=0)
    scale: float
    positions: Positions = "all"
    op: OpName = Field(DEFAULT_OP, exclude_if=lambda v: v == DEFAULT_OP)
    sha256: str = ""
    norm: float | None = None
    provenance: dict[str, Any] = Field(default_factory=dict)
    calibration: dict[str, Any] | None = None

    @field_validator("scale")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError(f"scale must be finite, got {v}")
        return v

    @model_validator(mode="after")
    def _op_scale(self) -> Intervention:
        why = OPS[self.op].scale_refusal(self.scale)
        if why is not None:
            raise ValueError(f"scale {self.scale} {why}")
        return self


#: ISO 639-1 codes the server's language detection can return (lingua's 75 languages; a test
#: checks the two agree). An artifact may gate ``auto`` per language only on these.
LANGUAGE_CODES: frozenset[str] = frozenset(
    "af ar az be bg bn bs ca cs cy da de el en eo es et eu fa fi fr ga gu he hi hr hu hy id is it "
    "ja ka kk ko la lg lt lv mi mk mn mr ms nb nl nn pa pl pt ro ru sk sl sn so sq sr st sv sw ta "
    "te th tl tn tr ts uk ur vi xh yo zh zu".split()
)
#: The largest per-language multiplier of the calibrated scales an artifact may declare.
MAX_LANGUAGE_MULTIPLIER = 8.0


class LanguageGate(_Strict):
    """How ``auto`` steers one language: every intervention at ``multiplier`` times its
    calibrated scale (0: not steered), and the confirmation that supports it."""

    #: the bounds also refuse NaN and infinities (they compare false or out of range)
    multiplier: float = Field(ge=0.0, le=MAX_LANGUAGE_MULTIPLIER)
    confirmation: dict[str, Any] | None = None


def _today() -> str:
    return _dt.date.today().isoformat()


class Manifest(_Strict):
    schema_version: Literal[1] = SCHEMA_VERSION
    name: str = Field(pattern=SLUG)
    version: str = Field(pattern=SLUG)
    created: str = Field(default_factory=_today)
    steerserve_version: str = __version__
    description: str = ""
    model: ModelBinding
    layer_convention: str = LAYER_CONVENTION
    interventions: list[Intervention] = Field(min_length=1)
    #: Per-language gate of ``auto`` (absent: every non-English language at the calibrated
    #: scales). A language not listed is not steered by ``auto``.
    languages: dict[str, LanguageGate] | None = None

    @field_validator("created")
    @classmethod
    def _iso(cls, v: str) -> str:
        try:
            _dt.datetime.fromisoformat(v)
        except ValueError:
            raise ValueError(f"created must be an ISO date, got {v!r}") from None
        return v

    @field_validator("layer_convention")
    @classmethod
    def _convention(cls, v: str) -> str:
        if v != LAYER_CONVENTION:
            raise ValueError(f"layer_convention must be {LAYER_CONVENTION!r}, got {v!r}")
        return v

    @field_validator("languages")
    @classmethod
    def _codes(cls, v: dict[str, LanguageGate] | None) -> dict[str, LanguageGate] | None:
        for code in v or {}:
            if code == "en":
                raise ValueError("languages.en: auto never steers English; leave it out")
            if code not in LANGUAGE_CODES:
                raise ValueError(
                    f"languages.{code}: not an ISO 639-1 code the server detects "
                    "(two lowercase letters, e.g. fr, ja, ko)"
                )
        return v

    @model_validator(mode="after")
    def _gated_scales(self) -> Manifest:
        """A language's multiplier must keep every bounded op's scale in its range (``interp``'s
        α in [0, 1]), or ``auto`` would be refused for that language at every request."""
        for code, gate in (self.languages or {}).items():
            for iv in self.interventions:
                why = OPS[iv.op].scale_refusal(iv.scale * gate.multiplier)
                if gate.multiplier and why is not None:
                    raise ValueError(
                        f"languages.{code}: multiplier {gate.multiplier:g} takes intervention "
                        f"{iv.name!r} to scale {iv.scale * gate.multiplier:g}, which {why}"
                    )
        return self

    def auto_multiplier(self, language: str | None) -> float:
        """The multiplier ``auto`` applies to a prompt in ``language`` (0: not steered)."""
        if language in (None, "en"):
            return 0.0
        if self.languages is None:
            return 1.0
        gate = self.languages.get(language)
        return gate.multiplier if gate is not None else 0.0

    def auto_languages(self) -> list[str] | None:
        """The languages ``auto`` steers (None: every non-English one)."""
        if self.languages is None:
            return None
        return sorted(k for k, g in self.languages.items() if g.multiplier > 0)

    @model_validator(mode="after")
    def _unique(self) -> Manifest:
        names = [iv.name for iv in self.interventions]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"duplicate intervention names: {dup}")
        return self

    def intervention(self, name: str) -> Intervention:
        for iv in self.interventions:
            if iv.name == name:
                return iv
        raise KeyError(f"{self.name}/{self.version} has no intervention {name!r}")

    def vector_name(self, intervention: Intervention | str) -> str:
        """Engine registration name: ``<name>/<version>/<intervention>``."""
        n = intervention if isinstance(intervention, str) else intervention.name
        return f"{self.name}/{self.version}/{n}"


@dataclass(frozen=True)
class Artifact:
    manifest: Manifest
    tensors: dict[str, torch.Tensor]
    path: Path | None = None

    @property
    def key(self) -> str:
        """``name/version``: how a server and its clients refer to the artifact."""
        return f"{self.manifest.name}/{self.manifest.version}"

    def named_vectors(self) -> dict[str, torch.Tensor]:
        """Engine name -> tensor, ready for ``SteerEngine.register_vector``."""
        m = self.manifest
        return {m.vector_name(iv): self.tensors[iv.tensor] for iv in m.interventions}

    def entries(
        self, choice: Iterable[str] | Mapping[str, float] | None = None
    ) -> tuple[SteeringEntry, ...]:
        """The calibrated steering entries of some (``choice``) or all interventions; a mapping
        ``{name: multiplier}`` also multiplies each calibrated scale. The one way from an
        artifact to engine entries."""
        m = self.manifest
        names = [iv.name for iv in m.interventions] if choice is None else list(choice)
        factor = choice if isinstance(choice, Mapping) else {}
        out = []
        for n in names:
            iv = m.intervention(n)
            scale = iv.scale * float(factor.get(n, 1.0))
            out.append(SteeringEntry(m.vector_name(iv), iv.layer, scale, iv.positions, iv.op))
        return tuple(out)


# --- model fingerprint -------------------------------------------------------------------------


def _config_sha256(cfg: Mapping[str, Any]) -> str:
    """Hash the keys that shape the network, normalised so config.json and a live config agree."""
    text = cfg.get("text_config") or cfg
    desc: dict[str, Any] = {
        "architectures": list(cfg.get("architectures") or []),
        "model_type": cfg.get("model_type"),
        "text_model_type": text.get("model_type") if text is not cfg else None,
    }
    for k in _SHAPE_KEYS:
        desc[k] = text.get(k)
    if desc["num_key_value_heads"] is None:
        desc["num_key_value_heads"] = desc["num_attention_heads"]
    if desc["head_dim"] is None and desc["hidden_size"] and desc["num_attention_heads"]:
        desc["head_dim"] = desc["hidden_size"] // desc["num_attention_heads"]
    canon = json.dumps(desc, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()


def _embedding_rows(vocab: int) -> list[int]:
    """Rows spread over the vocabulary: low ids are often unused tokens a fine-tune never moves."""
    return sorted({i * vocab // EMBED_ROWS for i in range(EMBED_ROWS)})


def _read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ArtifactError(f"model {str(model_dir)!r}: no config.json")
    return json.loads(path.read_text())


def fingerprint_model(model_dir: str | Path) -> Fingerprint:
    """Fingerprint a local HF checkpoint, reading only a small embedding slice from disk."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    cfg = _read_config(model_dir)
    found: list[tuple[str, Path]] = []
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as s:
            found += [(k, f) for k in s.keys() if k.endswith("embed_tokens.weight")]
    if not found:
        raise ArtifactError(f"model {str(model_dir)!r}: no *embed_tokens.weight in *.safetensors")
    name, f = min(found, key=lambda kf: (kf[0] != "model.embed_tokens.weight", len(kf[0]), kf[0]))
    with safe_open(str(f), framework="pt") as s:
        sl = s.get_slice(name)
        rows = [sl[r : r + 1, :EMBED_COLS] for r in _embedding_rows(sl.get_shape()[0])]
    return Fingerprint(
        config_sha256=_config_sha256(cfg), embedding_sha256=tensor_sha256(torch.cat(rows))
    )


def embedding_norm(model_dir: str | Path) -> float:
    """The typical norm of the residual stream's input: the median norm of the same spread rows
    of the token embeddings the fingerprint reads (all columns), times Gemma's sqrt(hidden_size)
    (its models scale embeddings by it). Read from disk once per scan: no forward pass."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    cfg = _read_config(model_dir)
    text = cfg.get("text_config") or cfg
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as s:
            names = [k for k in s.keys() if k.endswith("embed_tokens.weight")]
            if names:
                sl = s.get_slice(min(names, key=lambda k: (k != "model.embed_tokens.weight", k)))
                rows = torch.cat([sl[r : r + 1, :] for r in _embedding_rows(sl.get_shape()[0])])
                break
    else:
        raise ArtifactError(f"model {str(model_dir)!r}: no *embed_tokens.weight in *.safetensors")
    norm = float(rows.float().norm(dim=1).median())
    gemma = str(text.get("model_type") or cfg.get("model_type") or "").startswith("gemma")
    return norm * math.sqrt(int(text["hidden_size"])) if gemma else norm


def fingerprint_hf_model(model: Any) -> Fingerprint:
    """Same fingerprint for an in-memory transformers model (bind before saving anything)."""
    cfg = model.config.to_dict()
    if not cfg.get("architectures"):
        cfg["architectures"] = [type(model).__name__]
    weight = model.get_input_embeddings().weight.detach()
    sl = weight[_embedding_rows(weight.shape[0]), :EMBED_COLS].cpu()
    return Fingerprint(config_sha256=_config_sha256(cfg), embedding_sha256=tensor_sha256(sl))


def _binding(cfg: Mapping[str, Any], fp: Fingerprint, source: str) -> ModelBinding:
    text = cfg.get("text_config") or cfg
    archs = cfg.get("architectures") or ["?"]
    return ModelBinding(
        architecture=archs[0],
        num_layers=int(text["num_hidden_layers"]),
        hidden_size=int(text["hidden_size"]),
        fingerprint=fp,
        source=source,
    )


def binding_for_model(model_dir: str | Path) -> ModelBinding:
    model_dir = Path(model_dir)
    return _binding(_read_config(model_dir), fingerprint_model(model_dir), model_dir.name)


def binding_for_hf_model(model: Any, source: str = "") -> ModelBinding:
    cfg = model.config.to_dict()
    cfg["architectures"] = cfg.get("architectures") or [type(model).__name__]
    return _binding(cfg, fingerprint_hf_model(model), source)


def check_binding(expected: ModelBinding, got: ModelBinding, what: str) -> None:
    """Refuse ``got`` (the artifact's binding) unless it names the ``expected`` model."""
    diffs = [
        f"{k}: expected {getattr(expected, k)!r}, got {getattr(got, k)!r}"
        for k in ("architecture", "num_layers", "hidden_size")
        if getattr(expected, k) != getattr(got, k)
    ]
    e, g = expected.fingerprint, got.fingerprint
    if e.method != g.method:
        diffs.append(f"fingerprint method: expected {e.method!r}, got {g.method!r}")
    else:
        diffs += [
            f"fingerprint {k}: expected {getattr(e, k)[:16]}…, got {getattr(g, k)[:16]}…"
            for k in ("config_sha256", "embedding_sha256")
            if getattr(e, k) != getattr(g, k)
        ]
    if diffs:
        raise ModelMismatch(f"{what} was made for a different model: " + "; ".join(diffs))


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


def parse_manifest(raw: Any, where: str = "manifest") -> Manifest:
    """Validate a manifest dict: the schema version first, then the whole schema."""
    if not isinstance(raw, dict):
        raise ArtifactError(f"{where}: malformed manifest: not a JSON object")
    sv = raw.get("schema_version")
    if sv != SCHEMA_VERSION:
        raise ArtifactError(
            f"{where}: unknown schema_version {sv!r} (this steerserve reads {SCHEMA_VERSION})"
        )
    try:
        return Manifest.model_validate(raw)
    except ValidationError as e:
        why = "; ".join(f"{'.'.join(map(str, x['loc'])) or '.'}: {x['msg']}" for x in e.errors())
        raise ArtifactError(f"{where}: malformed manifest: {why}") from None


def read_manifest(path: str | Path) -> Manifest:
    """The manifest of an artifact directory, validated (tensors not read)."""
    p = Path(path) / MANIFEST_FILE
    if not p.is_file():
        raise ArtifactError(f"{path}: no {MANIFEST_FILE}")
    try:
        raw = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{p}: malformed manifest: invalid JSON: {e}") from None
    except RecursionError:  # one crafted file must not break every scan of the directory
        raise ArtifactError(f"{p}: malformed manifest: nested too deeply") from None
    except OSError as e:
        raise ArtifactError(f"{p}: unreadable: {e.strerror or e}") from None
    return parse_manifest(raw, str(p))


def load_artifact(
    path: str | Path,
    *,
    model_dir: str | Path | None = None,
    expect: ModelBinding | None = None,
) -> Artifact:
    """Load and verify an artifact; with ``model_dir``/``expect`` also check it fits that model."""
    from safetensors.torch import load_file

    path = Path(path)
    manifest = read_manifest(path)
    tf = path / TENSORS_FILE
    if not tf.is_file():
        raise ArtifactError(f"{path}: no {TENSORS_FILE}")
    try:
        tensors = load_file(str(tf))
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise ArtifactError(f"{tf}: unreadable: {e}") from None
    _check(manifest, tensors, str(path))
    if expect is None and model_dir is not None:
        expect = binding_for_model(model_dir)
    if expect is not None:
        check_binding(expect, manifest.model, f"{manifest.name}/{manifest.version}")
    return Artifact(manifest, tensors, path)


def _prepared(
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
    manifest, ts = _prepared(manifest, tensors)
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


def newest_first(arts: Iterable[Artifact]) -> list[Artifact]:
    """By name, each name's newest version first: the order a server loads artifacts in, so the
    first is the one it serves by default."""
    newest = _newest_version_first(arts, artifact_name_version)
    return sorted(newest, key=lambda a: a.manifest.name)


def default_vectors_dir() -> str:
    """Where the server, eval and analyze look for artifacts when not told: the shipped vectors
    of an installed package (``steerserve/vectors``, package data of the wheel: setup.py), else
    ``vectors/`` of the source tree (an editable install), else ./vectors."""
    package = Path(__file__).resolve().parent
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
        raise ArtifactError(f"no artifact {ref!r} under {str(root)!r}")
    return versions[0]


# --- llama.cpp GGUF control vectors ------------------------------------------------------------
# llama.cpp adds tensor ``direction.N`` to the output of decoder block N (0-based il == N), so
# N == our L; direction.0 is rejected by llama.cpp. See vectors/README.md for the evidence.

GGUF_ARCH = "controlvector"


def export_gguf(
    artifact: Artifact, path: str | Path, *, names: Iterable[str] | None = None
) -> Path:
    """Write interventions as a llama.cpp control vector, each scale baked into its direction.

    llama.cpp has one strength per file and steers every token, so ``positions`` is not kept
    by llama.cpp; interventions sharing a layer are summed into one ``direction.N``. It only
    adds, so an intervention whose op cannot be carried (``engine/ops.py``: ``gguf``) is refused.
    """
    import gguf

    m = artifact.manifest
    ivs = m.interventions if names is None else [m.intervention(n) for n in names]
    by_layer: dict[int, torch.Tensor] = {}
    for iv in ivs:
        if not OPS[iv.op].gguf:
            raise ArtifactError(
                f"intervention {iv.name!r}: op {iv.op!r} cannot be exported (a llama.cpp control "
                "vector only adds its direction to every token)"
            )
        if iv.layer == 0:
            raise ArtifactError(
                f"intervention {iv.name!r}: layer 0 cannot be exported (llama.cpp rejects "
                "direction.0; direction.N is added to the output of block N)"
            )
        if iv.scale == 0:
            raise ArtifactError(f"intervention {iv.name!r}: scale 0 would export a zero vector")
        if iv.positions != "all":
            log.warning("%s: llama.cpp steers all tokens, not %r", iv.name, iv.positions)
        v = artifact.tensors[iv.tensor].to(torch.float32) * iv.scale
        by_layer[iv.layer] = by_layer[iv.layer] + v if iv.layer in by_layer else v
    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch=GGUF_ARCH)
    w.add_string(f"{GGUF_ARCH}.model_hint", m.model.architecture)
    w.add_int32(f"{GGUF_ARCH}.layer_count", len(by_layer))
    w.add_string("steerserve.source", f"{m.name}/{m.version}")
    w.add_string("steerserve.layer_convention", LAYER_CONVENTION)
    w.add_string("steerserve.binding", m.model.model_dump_json())
    w.add_string("steerserve.interventions", json.dumps([iv.model_dump() for iv in ivs]))
    for layer in sorted(by_layer):
        w.add_tensor(f"direction.{layer}", by_layer[layer].contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def import_gguf(
    path: str | Path,
    *,
    name: str,
    version: str,
    model_dir: str | Path,
    intervention: str | None = None,
) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """Read a llama.cpp control vector as a manifest bound to ``model_dir`` plus its tensors.

    A file exported by steerserve gets its interventions back (direction / scale); a foreign
    file becomes one intervention per direction at scale 1, positions ``all``.
    """
    import gguf
    import numpy as np

    path = Path(path)
    r = gguf.GGUFReader(str(path))

    def field(key: str) -> Any:
        f = r.fields.get(key)
        return None if f is None else f.contents()

    if field("general.architecture") != GGUF_ARCH:
        raise ArtifactError(
            f"{path}: not a control vector (general.architecture {field('general.architecture')!r})"
        )
    binding = binding_for_model(model_dir)
    if field("steerserve.binding"):
        check_binding(
            binding, ModelBinding.model_validate_json(field("steerserve.binding")), str(path)
        )
    dirs: dict[int, torch.Tensor] = {}
    for t in r.tensors:
        mt = re.fullmatch(r"direction\.(\d+)", t.name)
        if mt is None or int(mt.group(1)) == 0:
            raise ArtifactError(f"{path}: tensor {t.name!r} is not direction.N with N >= 1")
        if t.tensor_type != gguf.GGMLQuantizationType.F32:
            raise ArtifactError(f"{path}: {t.name} is {t.tensor_type.name}, expected F32")
        n = int(mt.group(1))
        if n >= binding.num_layers:
            raise ArtifactError(
                f"{path}: {t.name}: layer {n} is out of range 0..{binding.num_layers - 1}"
            )
        dirs[n] = torch.from_numpy(np.array(t.data, dtype=np.float32).reshape(-1))
    if not dirs:
        raise ArtifactError(f"{path}: no direction tensors")
    origin = {"imported_from": path.name, "format": "llama.cpp control vector"}
    records = json.loads(field("steerserve.interventions") or "[]")
    ivs: list[Intervention] = []
    tensors: dict[str, torch.Tensor] = {}
    for layer, v in sorted(dirs.items()):
        here = [rec for rec in records if rec.get("layer") == layer]
        if len(here) == 1:
            rec = {**here[0], "sha256": "", "norm": None, "tensor": here[0]["name"]}
            rec["provenance"] = {**rec.get("provenance", {}), **origin}
            iv = Intervention.model_validate(rec)
            v = v / iv.scale
        else:
            base = "+".join(rec["name"] for rec in here) if here else (intervention or "control")
            nm = base if (here or len(dirs) == 1) else f"{base}.L{layer}"
            hint = field(f"{GGUF_ARCH}.model_hint")
            iv = Intervention(
                name=nm,
                tensor=nm,
                layer=layer,
                scale=1.0,
                positions="all",
                provenance={**origin, "model_hint": hint},
            )
        ivs.append(iv)
        tensors[iv.tensor] = v
    manifest = Manifest(
        name=name,
        version=version,
        model=binding,
        interventions=ivs,
        description=f"imported from {path.name}",
    )
    return _prepared(manifest, tensors)
