"""``steerserve vectors list|show|verify``: artifacts as a person reads them.

Why not in the CLI: what a listing shows, how a manifest is summarised and what counts as a
failed verification belong with the artifacts, not with option parsing; each function prints to
a rich console and returns the exit status.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from steerserve import artifacts as art


def console() -> Console:
    """A wide console that prints text as given (a manifest's text is not rich markup)."""
    return Console(width=200, markup=False, highlight=False)


def describe_auto(m: art.Manifest) -> str:
    """What ``auto`` does with an artifact, in one line (for show and gate)."""
    if m.languages is None:
        return "auto: every non-English language at the calibrated scales (no gate)"
    gates = ", ".join(f"{k} ×{g.multiplier:g}" for k, g in sorted(m.languages.items()))
    return f"auto steers: {', '.join(m.auto_languages() or []) or 'no language'} (gate: {gates})"


def list_artifacts(root: Path, out: Console | None = None) -> int:
    """One line per artifact under ``root``, 80 columns: name/version, model, layers, which
    languages ``auto`` steers (``none (gated)``: the gate closed every language), and ``*`` on
    the one a server of that model serves by default (the newest of the first name, as
    :func:`art.newest_first` orders them); one that does not read is listed as invalid."""
    out = out or console()
    rows: list[tuple[str, str, str, str, str]] = []
    read: list[tuple[Path, art.Manifest]] = []
    for p in art.find_artifacts(root):
        try:
            read.append((p, art.read_manifest(p)))
        except art.ArtifactError as e:
            why = str(e).replace(f"{p}: ", "").replace(str(p), ".")
            rows.append(("", str(p.relative_to(root)), "invalid", "", why))
    defaults = _defaults([m for _, m in read])
    for _, m in read:
        b = m.model
        auto = m.auto_languages()
        rows.append(
            (
                "*" if id(m) in defaults else "",
                f"{m.name}/{m.version}",
                f"{b.architecture.removesuffix('ForCausalLM')} {b.num_layers}x{b.hidden_size}",
                " ".join(f"L{iv.layer}" for iv in m.interventions),
                "all non-English" if auto is None else ", ".join(auto) or "none (gated)",
            )
        )
    if not rows:
        out.print(f"no artifacts under {root}")
        return 0
    width = max(len(r[1]) for r in rows)
    out.print(f"  {'artifact':<{width}}  {'model':<14} {'layers':<8} auto steers")
    for mark, name, model, layers, auto in rows:
        if model == "invalid":  # the reason on lines of its own, wrapped
            out.print(f"  {name:<{width}}  invalid")
            out.print(textwrap.fill(auto, 80, initial_indent="    ", subsequent_indent="    "))
            continue
        out.print(f"{mark or ' '} {name:<{width}}  {model:<14} {layers:<8} {auto}".rstrip())
    out.print("* served by default for its model; layers, scales, gate: vectors show NAME")
    return 0


def _defaults(manifests: Sequence[art.Manifest]) -> set[int]:
    """Which manifests (by ``id``) a server of their model would serve by default: per model
    binding, the first of the newest-first order by name."""
    by_model: dict[tuple[str, str], list[art.Manifest]] = {}
    for m in manifests:
        fp = m.model.fingerprint
        by_model.setdefault((fp.config_sha256, fp.embedding_sha256), []).append(m)
    out = set()
    for group in by_model.values():
        out.add(id(art.newest_first(group, lambda m: (m.name, m.version))[0]))
    return out


def tune_verdict(path: Path) -> str | None:
    """The verdict line of the report ``steerserve tune`` publishes beside an artifact."""
    import json

    try:
        verdict = json.loads((path / "report.json").read_text()).get("verdict")
    except (OSError, ValueError, AttributeError):
        return None
    return verdict if isinstance(verdict, str) else None


def show(ref: str, root: Path, out: Console | None = None) -> int:
    """One artifact: model binding, interventions, provenance, calibration winner; 1 when it
    cannot be found or read."""
    out = out or console()
    try:
        path = art.resolve_artifact(ref, root)
        m = art.read_manifest(path)
    except art.ArtifactError as e:
        out.print(str(e), style="red")
        return 1
    b, fp = m.model, m.model.fingerprint
    out.print(f"{m.name}/{m.version}", style="bold", end="")
    out.print(f"  ({path})  created {m.created}, steerserve {m.steerserve_version}")
    if m.description:
        out.print(m.description)
    out.print(f"model: {b.architecture}, {b.num_layers} layers, hidden {b.hidden_size}")
    out.print(f"  source {b.source!r}, config {fp.config_sha256[:16]}…, embedding ", end="")
    out.print(f"{fp.embedding_sha256[:16]}…")
    out.print(f"layers: {m.layer_convention}")
    out.print(describe_auto(m))
    if verdict := tune_verdict(path):
        out.print(f"tune verdict: {verdict} (report.md beside the manifest)", style="bold")
    for iv in m.interventions:
        out.print(m.vector_name(iv), style="bold", end="")
        out.print(
            f": layer {iv.layer}, scale {iv.scale:g}, positions {iv.positions}, "
            f"norm {iv.norm or 0:.4g}, sha256 {iv.sha256[:16]}…"
        )
        if iv.provenance:
            out.print("  provenance: " + ", ".join(f"{k}={v}" for k, v in iv.provenance.items()))
        cal = iv.calibration or {}
        if cal:
            rows = next((len(v) for v in cal.values() if isinstance(v, list)), 0)
            out.print(f"  calibration: objective {cal.get('objective', '?')}; ", end="")
            out.print(f"chosen {cal.get('chosen', '?')}; {rows} sweep rows")
    return 0


def verify(
    paths: Sequence[Path], root: Path, model: Path | None = None, out: Console | None = None
) -> int:
    """Load every artifact in ``paths`` (default: all under ``root``) with every check, and
    against ``model`` if given; 1 when any fails."""
    out = out or console()
    dirs = [d for p in (paths or [root]) for d in (art.find_artifacts(p) or [p])]
    try:
        expect = art.binding_for_model(model) if model is not None else None
    except art.ArtifactError as e:
        out.print(f"FAIL {e}", style="red")
        return 1
    failed = 0
    for d in dirs:
        try:
            a = art.load_artifact(d, expect=expect)
            out.print(f"OK   {d}  {a.manifest.name}/{a.manifest.version}", style="green")
        except art.ArtifactError as e:
            failed += 1
            msg = str(e)
            out.print(f"FAIL {msg if str(d) in msg else f'{d}: {msg}'}", style="red")
    return 1 if failed else 0
