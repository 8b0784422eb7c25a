"""The steering policy: a request's typed ``steering`` (or the server default), the detected
language and the loaded artifacts -> engine entries."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from steerserve.artifacts import Artifact, artifact_name_version, named
from steerserve.engine.ops import OPS
from steerserve.engine.spec import SteeringEntry, short_repr
from steerserve.server.answers import AppliedIntervention, SteeringInfo
from steerserve.server.errors import ApiError
from steerserve.server.steering import (
    DEFAULT_MODE,
    MODES,
    Auto,
    Entries,
    Multipliers,
    Off,
    On,
    SteeringSpec,
)

if TYPE_CHECKING:
    from steerserve.artifacts import Intervention
    from steerserve.engine.registry import VectorRegistry

logger = logging.getLogger(__name__)

#: Languages lingua chooses among. A closed set keeps memory (~0.3 GB) and start-up (~2 s) small
#: while covering the fact set's languages and other widely used ones.
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
class Decision:
    """What a request gets: engine entries, how to describe them, and the field admission errors
    about them belong to."""

    policy: str
    entries: tuple[SteeringEntry, ...] = ()
    echo: tuple[AppliedIntervention, ...] = ()
    detected_language: str | None = None
    field: str = "steering"
    auto_languages: tuple[str, ...] | None = None  # an auto decision under a language gate

    def info(self, applied: bool) -> SteeringInfo:
        return SteeringInfo(
            applied=applied,
            policy=self.policy,
            interventions=list(self.echo) if applied else [],
            detected_language=self.detected_language,
            auto_languages=None if self.auto_languages is None else list(self.auto_languages),
        )


OFF = Decision("off")
_DEFAULTS: dict[str, SteeringSpec] = {"off": Off(), "on": On(), "auto": Auto()}


@dataclass
class SteeringPolicy:
    """Loaded artifacts and the default mode; turns typed ``steering`` values into decisions."""

    registry: VectorRegistry
    default: str = DEFAULT_MODE
    max_abs_scale: float = 64.0
    artifacts: dict[str, Artifact] = field(default_factory=dict)
    default_artifact: str | None = None
    _by_vector: dict[str, tuple[Artifact, Intervention]] = field(
        default_factory=dict, init=False, repr=False
    )

    def __post_init__(self) -> None:
        if self.default not in MODES:
            raise ValueError(f"steering: {self.default!r} is not one of {', '.join(MODES)}")

    def add(self, art: Artifact, make_default: bool = False) -> None:
        self.artifacts[art.key] = art
        m = art.manifest
        self._by_vector.update({m.vector_name(iv): (art, iv) for iv in m.interventions})
        if make_default or self.default_artifact is None:
            self.default_artifact = art.key

    def detects(self, spec: SteeringSpec | None) -> bool:
        """Whether :meth:`resolve` needs the prompt's language for ``spec``."""
        return isinstance(spec if spec is not None else _DEFAULTS[self.default], Auto)

    def resolve(
        self, spec: SteeringSpec | None, *, language: str | None = None, force: bool = False
    ) -> Decision:
        """The decision for a request; None is the server default. ``force`` (the A/B endpoint's
        steered arm): absent and ``auto`` mean ``on``, and ``false`` is refused."""
        if spec is None:
            spec = On() if force else _DEFAULTS[self.default]
        match spec:
            case Off():
                if force:
                    raise ApiError(
                        "steering: the A/B endpoint compares against a steered arm; false is not "
                        "allowed",
                        param="steering",
                    )
                return OFF
            case Auto() if not force:
                return self._auto(language)
            case Auto() | On():
                policy = "on" if force or isinstance(spec, On) else "auto"
                return self._decision(policy, self._artifact(None).entries(), language)
            case Multipliers():
                art = self._artifact(spec.artifact)
                return self._decision(
                    "interventions", self._calibrated(art, spec.interventions), language
                )
            case Entries():
                return self._decision("entries", spec.entries, language, "steering.entries")
        raise TypeError(f"not a steering value: {spec!r}")

    def _auto(self, language: str | None) -> Decision:
        """``auto``: the default artifact on a non-English prompt, at the multiplier its
        manifest's per-language gate declares for the language (none: every non-English
        language at the calibrated scales); a gated-off language is answered unsteered."""
        if language in (None, "en"):
            return Decision("auto", detected_language=language)
        art = self._artifact(None)
        gated = art.manifest.auto_languages()
        langs = None if gated is None else tuple(gated)
        m = art.manifest.auto_multiplier(language)
        if m == 0:
            return Decision("auto", detected_language=language, auto_languages=langs)
        scaled = None if m == 1 else {iv.name: m for iv in art.manifest.interventions}
        d = self._decision("auto", art.entries(scaled), language)
        return dataclasses.replace(d, auto_languages=langs)

    def _artifact(self, ref: str | None) -> Artifact:
        """``ref``: None (the default), ``name/version``, or ``name`` (its newest version)."""
        if ref is None:
            if self.default_artifact is None:
                raise ApiError(
                    "steering: no steering artifact is loaded for this model (load one with "
                    "POST /v1/steering/vectors, or send steering: false)",
                    param="steering",
                    code="no_artifact",
                )
            return self.artifacts[self.default_artifact]
        if versions := named(ref, self.artifacts.values(), artifact_name_version):
            return versions[0]
        raise ApiError(
            f"steering.artifact: {short_repr(ref)} is not loaded; loaded: {', '.join(self.artifacts) or 'none'}",
            param="steering.artifact",
        )

    def _calibrated(
        self, art: Artifact, multipliers: Mapping[str, float] | None
    ) -> tuple[SteeringEntry, ...]:
        """The artifact's calibrated entries, scaled by ``multipliers`` (all of them at 1 if None);
        a scale beyond the engine's bound is refused here, naming the intervention."""
        known = {iv.name: iv for iv in art.manifest.interventions}
        for name, m in (multipliers or {}).items():
            f = f"steering.interventions.{name}"  # ApiError bounds its length
            iv = known.get(name)
            if iv is None:
                raise ApiError(
                    f"{f}: unknown intervention; {art.key} has {', '.join(known)}", param=f
                )
            scale = iv.scale * m
            if abs(scale) > self.max_abs_scale:
                raise ApiError(
                    f"{f}: multiplier {m:g} gives scale {scale:g} (calibrated {iv.scale:g}), "
                    f"outside [-{self.max_abs_scale:g}, {self.max_abs_scale:g}]",
                    param=f,
                )
            why = OPS[iv.op].scale_refusal(scale)
            if why is not None:
                raise ApiError(
                    f"{f}: multiplier {m:g} gives scale {scale:g} (calibrated {iv.scale:g}), "
                    f"which {why}",
                    param=f,
                )
        return art.entries(multipliers)

    def _decision(
        self,
        policy: str,
        entries: Sequence[SteeringEntry],
        language: str | None,
        field: str = "steering",
    ) -> Decision:
        echo = tuple(self._echo(e) for e in entries)
        return Decision(policy, tuple(entries), echo, language, field)

    def scoring(self, d: Decision) -> Decision:
        """``d`` for a request that scores its prompt (prompt logprobs: lm-eval's loglikelihood,
        echo + logprobs): it reads positions before the last prompt token, which steering from
        the last prompt token on never reaches, so every entry steers ``all`` positions (the
        echo says so). Without this a preset would label unsteered scores steered. Entries a
        client wrote out (``steering.entries``) keep the positions it chose."""
        if d.policy == "entries" or all(e.positions == "all" for e in d.entries):
            return d
        wide = [dataclasses.replace(e, positions="all") for e in d.entries]
        return dataclasses.replace(d, entries=tuple(wide), echo=tuple(self._echo(e) for e in wide))

    def _echo(self, e: SteeringEntry) -> AppliedIntervention:
        """How a response names an entry: its artifact and intervention when it is a loaded
        artifact's vector, and the first 12 hex digits of the vector's sha256."""
        art, iv = self._by_vector.get(e.vector, (None, None))
        sha = self.registry[e.vector].sha256[:12] if e.vector in self.registry else ""
        return AppliedIntervention(
            artifact=art.manifest.name if art else None,
            version=art.manifest.version if art else None,
            name=iv.name if iv else e.vector,
            sha256=sha,
            **dataclasses.asdict(e),  # the entry's fields, whatever they are
        )
