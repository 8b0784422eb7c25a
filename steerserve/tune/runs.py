"""What the stages' ``run(config)`` functions share: how a setting is refused, which artifact
and arms a run compares, and the plan a test runs under, so a notebook gets the command's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from steerserve.tune.arms import UNSTEERED, arm_names, check_arms


class ConfigError(ValueError):
    """A setting that cannot run, and the option (``param``) that says it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class RunError(RuntimeError):
    """A run that cannot start for a reason no single option names (no artifact to steer with,
    an artifact that does not load)."""


def model_dir(model: str | Path) -> Path:
    """The checkpoint folder of ``model`` (a folder, or an embedded model's name, converted on
    first use); an unknown one is a :class:`ConfigError` naming ``--model``."""
    from steerserve.models import resolve_model

    try:
        return Path(resolve_model(model))
    except ValueError as e:
        raise ConfigError(str(e), "--model") from None


def choose_artifact(
    ref: Path | None, model_dir: Path, vectors_dir: str | None, arms: tuple[str, ...]
) -> Any:
    """``ref``, else the artifact the server's ``auto`` would serve from ``vectors_dir``; None when
    only the unsteered arm is asked for, else :class:`RunError` naming what is missing."""
    from steerserve.artifacts import (
        ArtifactError,
        default_vectors_dir,
        load_artifact,
        preferred_artifact,
    )

    root = vectors_dir or default_vectors_dir()
    try:
        art = (
            load_artifact(ref, model_dir=model_dir)
            if ref is not None
            else preferred_artifact(root, model_dir)
        )
    except ArtifactError as e:
        raise RunError(str(e)) from None
    if art is None and arms != (UNSTEERED,):
        raise RunError(
            f"no steering artifact for the model {model_dir.name!r} under {root!r}: pass "
            f"--artifact DIR, or --arms {UNSTEERED} for the unsteered arm alone"
        )
    return art


def choose_arms(arms: tuple[str, ...], art: Any, controls: bool) -> tuple[str, ...]:
    """``arms``, or (empty) every arm of the artifact; unknown arms are a :class:`ConfigError`."""
    arms = arms or arm_names(art, controls=controls)
    try:
        check_arms(arms, art)
    except ValueError as e:
        raise ConfigError(str(e), "--arms") from None
    return arms


def artifact_form(art: Any) -> str | None:
    """The form an artifact was calibrated on (recorded with its calibration), if any."""
    if art is None:
        return None
    cal = art.manifest.interventions[0].calibration or {}
    return (cal.get("scoring") or {}).get("form")


def interventions(art: Any) -> dict[str, dict[str, Any]]:
    """Each intervention's calibrated layer, scale and positions, for a report's header."""
    return {
        iv.name: {"layer": iv.layer, "scale": iv.scale, "positions": iv.positions}
        for iv in art.manifest.interventions
    }


def declared_plan(plan: Path | None, out: Path) -> dict[str, str] | None:
    """The declared plan (file name and text), or None; refuses to run a test whose finished
    report, holding a plan, is already in ``out``: a test declared in advance runs once."""
    if plan is None:
        return None
    done = out / "report.json"
    if done.exists():
        old = json.loads(done.read_text(encoding="utf-8"))
        if old.get("plan") and old.get("finished"):
            raise ConfigError(
                f"{done} is a finished test with a declared plan; a test runs once: pass a new "
                "--out to run another",
                "--plan",
            )
    try:
        return {"file": plan.name, "text": plan.read_text(encoding="utf-8").strip()}
    except OSError as e:
        raise ConfigError(f"cannot read {plan}: {e.strerror}", "--plan") from None
