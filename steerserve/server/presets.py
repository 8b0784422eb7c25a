"""Steering presets served as model ids, the way vLLM serves a LoRA adapter, so clients that can
send only a model id can choose steering."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from steerserve.engine.spec import short_repr
from steerserve.server.steering import SteeringSpec

#: The presets a served artifact gives, by suffix: its calibrated interventions on every prompt,
#: and on non-English prompts only (``auto``, under the artifact's language gate if it has one).
DEFAULTS: dict[str, Any] = {"steering-on": True, "steering-auto": "auto"}

#: The characters of a preset name: lowercase ASCII, so a name cannot look like another (a
#: Cyrillic "о" in "steering-оn", a capital twin), hold a path separator, or hold the ``:`` that
#: ends ``<model>:`` in its model id.
_CHARS = "a-z0-9._-"
#: The rule every preset name follows (the defaults do): a letter or digit, then up to 62 more.
PRESET_NAME = re.compile(rf"[a-z0-9][{_CHARS}]{{0,62}}")
PRESET_NAME_RULE = "1 to 63 of a-z 0-9 . _ - (lowercase ASCII), starting with a letter or digit"
_OUTSIDE = re.compile(rf"[^{_CHARS}]")


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
        raise ValueError(
            f"{short_repr(text)}: expected NAME=SPEC (SPEC: a 'steering' value as JSON)"
        )
    check_name(name)
    bare = {"on": True, "true": True, "off": False, "false": False, "auto": "auto"}
    if spec in bare:
        return name, bare[spec]
    try:
        return name, json.loads(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name}: SPEC is not JSON ({e.msg})") from None


def check_name(name: str) -> str:
    """``name`` if it follows :data:`PRESET_NAME`; else a ValueError that says the rule and, for a
    look-alike, which character broke it (``'о' (U+043E)`` shows what the eye does not)."""
    if PRESET_NAME.fullmatch(name):
        return name
    why = f"{len(name)} characters" if name else "empty"
    if (bad := _OUTSIDE.search(name)) is not None:
        why = f"{bad.group()!r} (U+{ord(bad.group()):04X}) is not allowed"
    elif name and not name[0].isalnum():
        why = f"starts with {name[0]!r}"
    raise ValueError(f"preset name {short_repr(name)}: {why}; a preset name is {PRESET_NAME_RULE}")


def preset_id(model: str, name: str) -> str:
    """A preset's model id, ``<model>:<name>``; a name outside :data:`PRESET_NAME` (a
    programmatic ``ab_preset``, say) is a ValueError saying the rule."""
    return f"{model}:{check_name(name)}"
