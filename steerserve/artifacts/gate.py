"""``steerserve vectors gate``: a new version of an artifact with the same vectors and a
per-language gate of ``auto``."""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from rich.console import Console

from steerserve import __version__
from steerserve import artifacts as art
from steerserve.artifacts.view import console, describe_auto


def read_gates(path: Path) -> dict[str, Any]:
    """The ``languages`` object of ``path`` (JSON): refused, naming the file, when it is not one."""
    try:
        raw = json.loads(path.read_text())
    except OSError as e:
        raise art.ArtifactError(f"{path}: unreadable: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise art.ArtifactError(f"{path}: invalid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise art.ArtifactError(
            f'{path}: must be a JSON object of languages, e.g. {{"fr": {{"multiplier": 0}}}}'
        )
    return raw


def gated_manifest(
    src: art.Manifest,
    version: str,
    languages: dict[str, Any],
    description: str | None = None,
) -> art.Manifest:
    """``src`` as version ``version`` gated by ``languages``, validated by the manifest's rules
    (an unknown code, ``en``, a multiplier out of bounds or not finite is refused, the field
    named). The interventions are kept; each records the version it was copied from."""
    raw = src.model_dump(mode="json")
    key = f"{src.name}/{src.version}"
    for iv in raw["interventions"]:
        iv["provenance"] = {**iv["provenance"], "copied_from": key}
    raw.update(
        version=version,
        created=_dt.date.today().isoformat(),
        steerserve_version=__version__,
        description=src.description if description is None else description,
        languages=languages,
    )
    try:
        return art.Manifest.model_validate(raw)
    except ValidationError as e:
        why = "; ".join(_error(x) for x in e.errors())
        raise art.ArtifactError(f"{src.name}/{version}: refused: {why}") from None


def _error(x: Any) -> str:
    """One pydantic error as ``field: message``, with the value when it is a scalar (a NaN
    multiplier reads "must be <= 8 (got nan)", not only the bound)."""
    got = x.get("input")
    val = f" (got {got!r})" if isinstance(got, int | float | str | None) else ""
    return f"{'.'.join(map(str, x['loc']))}: {x['msg']}{val}"


def gate(
    src: str,
    version: str,
    gates_file: Path,
    root: Path,
    description: str | None = None,
    out: Console | None = None,
) -> int:
    """Write ``root/<name>/<version>/``: the verified artifact ``src`` with the gate of
    ``gates_file``; 1, with the reason, when the source, the gate or the version is refused
    (nothing is written then)."""
    out = out or console()
    try:
        source = art.load_artifact(art.resolve_artifact(src, root))
        languages = read_gates(gates_file)
        manifest = gated_manifest(source.manifest, version, languages, description)
        dest = root / manifest.name / manifest.version
        if dest.exists():
            raise art.ArtifactError(f"{dest} exists already: a published version never changes")
        written = art.save_artifact(dest, manifest, source.tensors)
        art.load_artifact(dest)  # what was written verifies like any shipped artifact
    except art.ArtifactError as e:
        out.print(str(e), style="red")
        return 1
    out.print(f"wrote {dest}  {written.key} (the vectors of {source.key})", style="green")
    out.print(describe_auto(manifest))
    return 0
