"""The arms an artifact is compared in: ``unsteered``, each intervention, ``both``, and
same-norm controls (``random``, ``random_signs``) that ask "does any push of this size do it?".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from steerserve.engine.spec import SteeringEntry

UNSTEERED = "unsteered"
COMBINED = "both"
CONTROLS: tuple[str, ...] = ("random", "random_signs")
CONTROL_SEED = 1234


def arm_names(artifact: Any, controls: bool = True) -> tuple[str, ...]:
    """The arms of ``artifact``: unsteered, each intervention, all together, then (if
    ``controls``) the controls; without an artifact only the unsteered arm."""
    if artifact is None:
        return (UNSTEERED,)
    names = tuple(iv.name for iv in artifact.manifest.interventions)
    return (UNSTEERED, *names, COMBINED, *(CONTROLS if controls else ()))


def check_arms(arms: Sequence[str], artifact: Any) -> None:
    """Refuse unknown arms, and steered arms without an artifact, naming what is missing."""
    if artifact is None:
        steered = [a for a in arms if a != UNSTEERED]
        if steered:
            raise ValueError(
                f"arms {steered} need an artifact; without one only {UNSTEERED!r} runs"
            )
        return
    known = arm_names(artifact)
    unknown = [a for a in arms if a not in known]
    if unknown:
        raise ValueError(f"unknown arms {unknown}; known: {', '.join(known)}")


def arm_entries(artifact: Any, arm: str) -> tuple[SteeringEntry, ...]:
    """The steering entries of ``arm`` (none for the unsteered arm), from the artifact's
    calibrated settings; the controls name the control vectors of :func:`arm_vectors`."""
    if arm == UNSTEERED:
        return ()
    if arm in CONTROLS:
        return tuple(replace(e, vector=f"{e.vector}.{arm}") for e in artifact.entries())
    if arm == COMBINED:
        return artifact.entries()
    check_arms([arm], artifact)
    return artifact.entries([arm])


def arm_vectors(artifact: Any, seed: int = CONTROL_SEED) -> dict[str, torch.Tensor]:
    """The artifact's vectors by engine name, and each one's controls (``<name>.random``,
    ``<name>.random_signs``), seeded per vector."""
    out: dict[str, torch.Tensor] = {}
    for i, (name, v) in enumerate(sorted(artifact.named_vectors().items())):
        out[name] = v
        out[f"{name}.random"] = random_like(v, seed + i)
        out[f"{name}.random_signs"] = random_signs_like(v, seed + i)
    return out


def random_like(v: torch.Tensor, seed: int) -> torch.Tensor:
    """A random direction with the same norm as ``v``."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(v.numel(), generator=g, dtype=torch.float32)
    return r / r.norm() * v.float().norm()


def random_signs_like(v: torch.Tensor, seed: int) -> torch.Tensor:
    """``v`` with a random sign per dimension: same norm, same per-dimension magnitudes."""
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (v.numel(),), generator=g).float() * 2 - 1
    return v.float().flatten() * signs


def base_arm(arms: Mapping[str, Any]) -> str:
    """The arm others are compared with: the unsteered one, else the first."""
    return UNSTEERED if UNSTEERED in arms else next(iter(arms))
