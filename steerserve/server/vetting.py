"""Vetting the artifacts a server would serve, before it serves them: each must verify, fit the
engine's scale bound, add no more than the model's residual stream can carry and own its
name/version alone. One place for these rules, used at start (before the engine, so a refusal
costs no engine start) and by the admin load (:func:`loadable`)."""

from __future__ import annotations

import logging
from pathlib import Path

from steerserve.artifacts import Artifact, Scanned, named
from steerserve.server.errors import ApiError

logger = logging.getLogger("steerserve.server")

#: The most a vector may add, at the engine's largest scale, in norms of the model's token
#: embeddings (``artifacts.embedding_norm``). Residual norms grow with depth: measured on the
#: served models, up to 1.35e3 x (gemma-3-270m, layer 16: 35189 vs 26.1), 1.3e2 x (Qwen2.5-Coder
#: 1.5B, layer 22); their shipped vectors at scale 64 add 8.6e4 x and 8.2e3 x. Past 1e6 x a delta
#: drowns the stream by orders of magnitude, and further out (a norm past float32's square root,
#: 1.8e19) RMSNorm's sum of squares overflows and every next-token distribution comes out uniform.
MAX_DELTA_EMBEDDINGS = 1e6


def check_artifacts(found: list[Scanned], max_abs_scale: float) -> None:
    """Every artifact made for this model must verify and fit the engine: one that does not
    (corrupt manifest or tensors, sha256 mismatch, a calibrated scale the engine refuses, two
    folders with one name/version) stops the start, under every policy, since serving on would
    silently answer without the steering asked for, or with an older version of it. Artifacts
    bound to other models are skipped."""
    mine = [s for s in found if not s.other_model]
    bad = [f"{s.path}: {s.refused}" for s in mine if s.refused]
    bad += [f"{s.path}: {why}" for s in mine if (why := refusal(s, max_abs_scale))]
    keys: dict[tuple[str, str], list[Scanned]] = {}
    for s in mine:
        keys.setdefault((s.name, s.version), []).append(s)
    bad += [duplicate_refusal(same) for same in keys.values() if len(same) > 1]
    if bad:
        raise RuntimeError("artifacts failed verification: " + "; ".join(bad))
    for s in found:
        if s.other_model:
            logger.info("skipping %s: %s", s.path, s.refused)


def scale_refusal(art: Artifact, max_abs_scale: float) -> str | None:
    """Why the engine would refuse an artifact's calibrated entries (every ``true``/``auto``
    request would then be a 400 blaming its client), or None."""
    gates = art.manifest.languages or {}
    most = max((g.multiplier for g in gates.values()), default=1.0)
    for iv in art.manifest.interventions:
        if abs(iv.scale) > max_abs_scale:
            return (
                f"intervention {iv.name!r} has scale {iv.scale:g}, outside the engine's "
                f"[-{max_abs_scale:g}, {max_abs_scale:g}] (EngineConfig.max_abs_scale)"
            )
        if abs(iv.scale * most) > max_abs_scale:
            lang = max(gates, key=lambda k: gates[k].multiplier)
            return (
                f"languages.{lang}.multiplier {most:g} gives intervention {iv.name!r} scale "
                f"{iv.scale * most:g}, outside the engine's [-{max_abs_scale:g}, "
                f"{max_abs_scale:g}] (EngineConfig.max_abs_scale)"
            )
    return None


def magnitude_refusal(s: Scanned, max_abs_scale: float) -> str | None:
    """Why a vector is too large for the model: at the largest scale a request may ask, it would
    add more than :data:`MAX_DELTA_EMBEDDINGS` token-embedding norms (finite garbage, or a
    residual stream overflowed into empty answers), or None."""
    if s.artifact is None or s.embedding_norm is None:
        return None
    bound = MAX_DELTA_EMBEDDINGS * s.embedding_norm
    for iv in s.artifact.manifest.interventions:
        delta = max_abs_scale * float(s.artifact.tensors[iv.tensor].float().norm())
        if not delta <= bound:  # NaN-safe
            return (
                f"intervention {iv.name!r}: its vector's norm {delta / max_abs_scale:.3g} at the "
                f"engine's largest scale {max_abs_scale:g} adds {delta:.3g} to the residual "
                f"stream, over {MAX_DELTA_EMBEDDINGS:g} x the norm of the model's token "
                f"embeddings ({s.embedding_norm:.3g}): the model's own state would be drowned"
            )
    return None


def refusal(s: Scanned, max_abs_scale: float) -> str | None:
    """Why a verified artifact cannot be served on this engine (scale, magnitude), or None."""
    if s.artifact is None:
        return None
    return scale_refusal(s.artifact, max_abs_scale) or magnitude_refusal(s, max_abs_scale)


def duplicate_refusal(same: list[Scanned]) -> str:
    """Two folders claiming one name/version: which one is served would depend on path order."""
    folders = " and ".join(str(s.path) for s in same)
    return f"{same[0].name}/{same[0].version} is in more than one folder: {folders}"


def loadable(found: list[Scanned], ref: str, max_abs_scale: float, root: str | None) -> Artifact:
    """The artifact ``ref`` (``name/version``, or ``name``: its newest version) names among the
    scanned ``found``: 404 when there is none, 422 with the reason when it fails verification,
    fits another model, passes the engine's scale bound or the model's magnitude bound, or owns
    its name/version with another folder (paths relative to the vectors directory ``root``: the
    server's are its own)."""
    hits = named(ref, found, lambda s: (s.name, s.version))
    if not hits:
        raise ApiError(
            f"name: no artifact {ref!r} in the vectors directory",
            status=404,
            param="name",
            code="artifact_not_found",
        )
    newest = hits[0]
    same = [s for s in hits if (s.name, s.version) == (newest.name, newest.version)]
    why = newest.refused
    if len(same) > 1:
        why = duplicate_refusal(same)
    elif newest.artifact is not None:
        why = refusal(newest, max_abs_scale)
    if why or newest.artifact is None:
        base = str(Path(root or ".").resolve())
        raise ApiError(
            f"name: {newest.name}/{newest.version} cannot be loaded: "
            + str(why).replace(base + "/", ""),
            status=422,
            param="name",
            code="artifact_refused",
        )
    return newest.artifact
