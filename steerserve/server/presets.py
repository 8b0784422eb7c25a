"""Steering presets served as model ids: a named steering configuration is chosen by ``model``
alone, the way vLLM serves a LoRA adapter as its own model id (listed with its base model as
``parent``), so clients that can send nothing but a model id (chat front ends' model pickers,
lm-evaluation-harness, SDK wrappers that drop unknown fields) can choose steering.

A preset is any ``steering`` value the API accepts. The served artifact gives two
(:data:`DEFAULTS`); ``serve --preset NAME=SPEC`` adds more. Each is checked when the server
starts (its vectors admitted), so a preset that names a missing vector never serves.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from steerserve.server.steering import SteeringSpec

#: The presets a served artifact gives, by suffix: its calibrated interventions on every prompt,
#: and on non-English prompts only (``auto``, under the artifact's language gate if it has one).
DEFAULTS: dict[str, Any] = {"steering-on": True, "steering-auto": "auto"}


@dataclass(frozen=True)
class Preset:
    """A model id that stands for the base model with this steering."""

    id: str
    spec: SteeringSpec
    raw: Any  # the ``steering`` value as given (what the listing shows)
    source: str  # "artifact" (a default) or "--preset"


def parse_option(text: str) -> tuple[str, Any]:
    """``NAME=SPEC`` as (NAME, SPEC's JSON value); a bare ``on``/``off``/``auto`` is accepted for
    ``true``/``false``/``"auto"``. A ValueError says what is wrong."""
    name, sep, spec = text.partition("=")
    name, spec = name.strip(), spec.strip()
    if not sep or not name or not spec:
        raise ValueError(f"{text!r}: expected NAME=SPEC (SPEC: a 'steering' value as JSON)")
    if not all(c.isalnum() or c in "-_.:/" for c in name):
        raise ValueError(f"{name!r}: a preset name is letters, digits and - _ . : /")
    bare = {"on": True, "true": True, "off": False, "false": False, "auto": "auto"}
    if spec in bare:
        return name, bare[spec]
    try:
        return name, json.loads(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name}: SPEC is not JSON ({e.msg})") from None


def preset_id(model: str, name: str) -> str:
    """A preset's model id: ``<model>:<name>``, or the name as given when it has a ``:``."""
    return name if ":" in name else f"{model}:{name}"
