"""The steering policy: a request's ``steering`` field (or the server default) -> engine entries.

``false`` off; ``true`` the default artifact's interventions at their calibrated settings;
``"auto"`` on only when the prompt is not English (lingua, offline); an object multiplies the
calibrated scales or gives explicit engine entries. Every refusal is an :class:`ApiError` naming
the field, so a request is never answered unsteered when it asked for steering.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from steerserve.server.protocol import ApiError, AppliedIntervention, SteeringInfo

if TYPE_CHECKING:
    from steerserve.artifacts import Artifact
    from steerserve.engine.registry import VectorRegistry

logger = logging.getLogger(__name__)

MODES = ("off", "on", "auto")

#: Languages lingua chooses among. A closed set keeps memory (~0.3 GB) and start-up (~2 s) small
#: while covering the paper's languages and the facts' languages.
DETECT_LANGUAGES = (
    "ENGLISH FRENCH GERMAN SPANISH ITALIAN PORTUGUESE DUTCH RUSSIAN UKRAINIAN POLISH TURKISH "
    "ARABIC HINDI JAPANESE CHINESE KOREAN VIETNAMESE INDONESIAN SWEDISH"
).split()


class LanguageDetector:
    """Offline language detection; the models load on first use (or :meth:`warm`)."""

    def __init__(self, languages: Sequence[str] = DETECT_LANGUAGES) -> None:
        self.languages = tuple(languages)
        self._detector: Any = None
        self._lock = threading.Lock()

    def _get(self) -> Any:
        with self._lock:
            if self._detector is None:
                from lingua import Language, LanguageDetectorBuilder

                langs = [getattr(Language, name) for name in self.languages]
                # A small minimum distance: one-word prompts come back None (= not sure).
                self._detector = (
                    LanguageDetectorBuilder.from_languages(*langs)
                    .with_minimum_relative_distance(0.05)
                    .build()
                )
                self._detector.detect_language_of("warm up the language models")
            return self._detector

    def warm(self) -> None:
        self._get()

    def detect(self, text: str) -> str | None:
        """ISO 639-1 code of ``text``'s language, or None when unsure."""
        if not text.strip():
            return None
        lang = self._get().detect_language_of(text[-2000:])
        return None if lang is None else lang.iso_code_639_1.name.lower()


@dataclass(frozen=True)
class Intervention:
    """One shipped intervention as the server applies it (calibrated defaults)."""

    artifact: str
    version: str
    name: str
    vector: str
    layer: int
    scale: float
    positions: str


@dataclass
class LoadedArtifact:
    name: str
    version: str
    interventions: dict[str, Intervention]
    manifest: dict[str, Any]
    path: str | None = None

    @property
    def key(self) -> str:
        return f"{self.name}/{self.version}"

    @classmethod
    def from_artifact(cls, art: Artifact) -> LoadedArtifact:
        m = art.manifest
        ivs = {
            iv.name: Intervention(
                m.name, m.version, iv.name, m.vector_name(iv), iv.layer, iv.scale, iv.positions
            )
            for iv in m.interventions
        }
        path = None if art.path is None else str(art.path)
        return cls(m.name, m.version, ivs, m.model_dump(mode="json"), path)


@dataclass(frozen=True)
class Decision:
    """What a request gets: the engine entries and how to describe them."""

    policy: str
    entries: tuple[dict[str, Any], ...] = ()
    echo: tuple[AppliedIntervention, ...] = ()
    detected_language: str | None = None

    def info(self, applied: bool) -> SteeringInfo:
        return SteeringInfo(
            applied=applied,
            policy=self.policy,
            interventions=list(self.echo) if applied else [],
            detected_language=self.detected_language,
        )


_OFF = Decision("off")


@dataclass
class SteeringPolicy:
    """Loaded artifacts and the default mode; turns ``steering`` values into decisions."""

    registry: VectorRegistry
    default: str = "auto"
    max_abs_scale: float = 64.0
    artifacts: dict[str, LoadedArtifact] = field(default_factory=dict)
    default_artifact: str | None = None
    detector: LanguageDetector = field(default_factory=LanguageDetector)

    def add(self, art: LoadedArtifact, make_default: bool = False) -> None:
        self.artifacts[art.key] = art
        if make_default or self.default_artifact is None:
            self.default_artifact = art.key

    # --- parsing -------------------------------------------------------------------------------

    def mode_of(self, raw: Any) -> str:
        """off / on / auto / object; ``None`` means the server default."""
        if raw is None:
            return self.default
        if raw is True:
            return "on"
        if raw is False:
            return "off"
        if isinstance(raw, str):
            if raw in MODES:
                return raw
            raise ApiError(
                f'steering: {raw!r} is not one of false, true, "auto" (or an object)',
                param="steering",
            )
        if isinstance(raw, Mapping):
            return "object"
        raise ApiError(
            "steering: must be false, true, \"auto\", or an object with 'interventions' or "
            f"'entries'; got {type(raw).__name__}",
            param="steering",
        )

    def needs_language(self, raw: Any) -> bool:
        return self.mode_of(raw) == "auto"

    def resolve(self, raw: Any, *, language: str | None = None, force: bool = False) -> Decision:
        """The decision for a request. ``force`` (A/B): "auto" and the default mean "on"."""
        mode = "on" if force and raw is None else self.mode_of(raw)
        if force and mode == "off":
            raise ApiError(
                "steering: the A/B endpoint compares against a steered arm; false is not allowed",
                param="steering",
            )
        if mode == "off":
            return _OFF
        if mode == "object":
            return self._object(raw, language)
        if mode == "auto" and not force:
            if language is None or language == "en":
                return Decision("auto", detected_language=language)
            return self._calibrated(self._artifact(None), {}, "auto", language)
        return self._calibrated(self._artifact(None), {}, "on", language)

    def _artifact(self, key: Any) -> LoadedArtifact:
        if key is None:
            if self.default_artifact is None:
                raise ApiError(
                    "steering: no steering artifact is loaded for this model (load one with "
                    "POST /v1/steering/vectors, or send steering: false)",
                    param="steering",
                    code="no_artifact",
                )
            return self.artifacts[self.default_artifact]
        if not isinstance(key, str):
            raise ApiError("steering.artifact: must be a string", param="steering.artifact")
        if key in self.artifacts:
            return self.artifacts[key]
        matches = sorted(k for k, a in self.artifacts.items() if a.name == key)
        if matches:
            from steerserve.artifacts import _version_key

            return self.artifacts[max(matches, key=lambda k: _version_key(k.split("/", 1)[1]))]
        raise ApiError(
            f"steering.artifact: {key!r} is not loaded; loaded: {', '.join(self.artifacts) or 'none'}",
            param="steering.artifact",
        )

    def _object(self, raw: Mapping[str, Any], language: str | None) -> Decision:
        unknown = sorted(set(raw) - {"interventions", "entries", "artifact"})
        if unknown:
            raise ApiError(
                f"steering.{unknown[0]}: unknown field (use 'interventions' or 'entries')",
                param=f"steering.{unknown[0]}",
            )
        if "entries" in raw:
            if "interventions" in raw or "artifact" in raw:
                raise ApiError(
                    "steering: 'entries' cannot be combined with 'interventions' or 'artifact'",
                    param="steering",
                )
            return self._entries(raw["entries"], language)
        art = self._artifact(raw.get("artifact"))
        mult = raw.get("interventions")
        if mult is None:
            mult = {name: 1.0 for name in art.interventions}
        if not isinstance(mult, Mapping) or not mult:
            raise ApiError(
                "steering.interventions: must be a non-empty object {name: multiplier}",
                param="steering.interventions",
            )
        return self._calibrated(art, mult, "interventions", language)

    def _calibrated(
        self,
        art: LoadedArtifact,
        multipliers: Mapping[str, Any],
        policy: str,
        language: str | None,
    ) -> Decision:
        """Entries at calibrated settings; ``multipliers`` (if given) picks and scales them."""
        chosen = multipliers or {name: 1.0 for name in art.interventions}
        entries, echo = [], []
        for name, m in chosen.items():
            f = f"steering.interventions.{name}"
            iv = art.interventions.get(name)
            if iv is None:
                raise ApiError(
                    f"{f}: unknown intervention; {art.key} has {', '.join(art.interventions)}",
                    param=f,
                )
            if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m):
                raise ApiError(f"{f}: the multiplier must be a finite number, got {m!r}", param=f)
            scale = iv.scale * float(m)
            if abs(scale) > self.max_abs_scale:
                raise ApiError(
                    f"{f}: multiplier {m} gives scale {scale:g} (calibrated {iv.scale:g}), "
                    f"outside [-{self.max_abs_scale:g}, {self.max_abs_scale:g}]",
                    param=f,
                )
            entries.append(
                {"vector": iv.vector, "layer": iv.layer, "scale": scale, "positions": iv.positions}
            )
            echo.append(self._echo(iv.vector, iv.layer, scale, iv.positions, iv))
        return Decision(policy, tuple(entries), tuple(echo), language)

    def _entries(self, raw: Any, language: str | None) -> Decision:
        if not isinstance(raw, list) or not raw:
            raise ApiError(
                "steering.entries: must be a non-empty list of {vector, layer, scale, positions}",
                param="steering.entries",
            )
        # Admission validates the entries in full; this only builds the echo.
        echo = []
        for e in raw:
            if isinstance(e, Mapping) and isinstance(e.get("vector"), str):
                scale = e.get("scale", 1.0)
                echo.append(
                    self._echo(
                        e["vector"],
                        e.get("layer") if isinstance(e.get("layer"), int) else -1,
                        float(scale) if isinstance(scale, (int, float)) else 0.0,
                        str(e.get("positions", "all")),
                        self._by_vector(e["vector"]),
                    )
                )
        return Decision("entries", tuple(raw), tuple(echo), language)

    def _by_vector(self, vector: str) -> Intervention | None:
        for art in self.artifacts.values():
            for iv in art.interventions.values():
                if iv.vector == vector:
                    return iv
        return None

    def _echo(
        self, vector: str, layer: int, scale: float, positions: str, iv: Intervention | None
    ) -> AppliedIntervention:
        sha = self.registry[vector].sha256[:12] if vector in self.registry else ""
        return AppliedIntervention(
            artifact=iv.artifact if iv else None,
            version=iv.version if iv else None,
            name=iv.name if iv else vector,
            vector=vector,
            sha256=sha,
            layer=layer,
            scale=scale,
            positions=positions,
        )
