"""An artifact's manifest: the schema (bound model, interventions, language gate), its
validation, and the loaded artifact. An off-by-one layer or a vector from another model silently
weakens steering, so every field is checked and refused with the reason (:class:`ArtifactError`)."""

from __future__ import annotations

import datetime as _dt
import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    create_model,
    field_validator,
    model_serializer,
    model_validator,
)

from steerserve import __version__
from steerserve.engine.ops import DEFAULT_OP, OPS
from steerserve.engine.spec import SteeringEntry, entry_fields

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
LAYER_CONVENTION = "output of decoder block L (0-based) = transformers hidden_states[L+1]"
MANIFEST_FILE = "manifest.json"
TENSORS_FILE = "vectors.safetensors"
EMBED_ROWS, EMBED_COLS = 64, 256
FINGERPRINT_METHOD = (
    "steerserve-fp-v1: sha256 of canonical JSON of the config's shape keys; "
    f"sha256 of float32 embed_tokens.weight[rows i*vocab//{EMBED_ROWS} for i<{EMBED_ROWS}, "
    f"cols 0:{EMBED_COLS}]"
)
SHAPE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)
SLUG = r"^[A-Za-z0-9][A-Za-z0-9_.:@+-]{0,99}$"  # a path segment of an engine vector name


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


#: An entry's layer, scale, positions and op, with their types, bounds and defaults, as the
#: steering entry declares them (``engine/spec.py``): an intervention is an entry whose vector is
#: the artifact's own (``name``, stored as ``tensor``).
_EntryFields = create_model(
    "_EntryFields", __base__=_Strict, __module__=__name__, **entry_fields(leave_out={"vector"})
)


class Intervention(_EntryFields):  # type: ignore[misc,valid-type]
    """One vector with its recommended use: the entry (``op``, default: add ``scale * v``, at the
    output of block ``layer``) the artifact recommends for its vector ``name``. ``op`` is written
    only when it is not ``add``, so a manifest of additive interventions reads as it did before
    operations existed (and older readers still load it)."""

    name: str = Field(pattern=SLUG)
    tensor: str = Field(min_length=1)
    sha256: str = ""
    norm: float | None = None
    provenance: dict[str, Any] = Field(default_factory=dict)
    calibration: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _op_scale(self) -> Intervention:
        why = OPS[self.op].scale_refusal(self.scale)
        if why is not None:
            raise ValueError(f"scale {self.scale} {why}")
        return self

    @model_serializer(mode="wrap")
    def _additive_unsaid(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out = handler(self)
        if out.get("op") == DEFAULT_OP:
            del out["op"]
        return out


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
