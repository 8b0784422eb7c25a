"""steerserve command line (typer)."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(
    help="steerserve: multilingual factual-recall steering for vLLM.", no_args_is_help=True
)


@app.callback()
def _root() -> None:
    """Serve, build and evaluate steering vectors."""


# --- vectors: inspect and verify artifacts ------------------------------------------------------

vectors_app = typer.Typer(
    help="Inspect and verify steering-vector artifacts (vectors/<model>/<version>/).",
    no_args_is_help=True,
)
app.add_typer(vectors_app, name="vectors")
_ROOT_HELP = "Directory holding the artifacts (vectors/<model>/<version>/)."


@vectors_app.command("list")
def vectors_list(root: Path = typer.Option(Path("vectors"), help=_ROOT_HELP)) -> None:
    """List the artifacts under ROOT with their model and recommended layer/scale."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from steerserve import artifacts as art

    table = Table("name", "version", "model", "interventions", "layer / scale / positions")
    for p in art.find_artifacts(root):
        try:
            m = art.read_manifest(p)
        except art.ArtifactError as e:
            table.add_row(str(p.relative_to(root)), "", "", Text(f"invalid: {e}", style="red"), "")
            continue
        b = m.model
        ivs = m.interventions
        table.add_row(
            m.name,
            m.version,
            f"{b.architecture} ({b.num_layers}×{b.hidden_size})",
            "\n".join(iv.name for iv in ivs),
            "\n".join(f"L{iv.layer} × {iv.scale:g} ({iv.positions})" for iv in ivs),
        )
    Console(width=200).print(table if table.row_count else f"no artifacts under {root}")


@vectors_app.command("show")
def vectors_show(
    ref: str = typer.Argument(
        help="NAME[/VERSION] under ROOT (latest version if omitted), or a path."
    ),
    root: Path = typer.Option(Path("vectors"), help=_ROOT_HELP),
) -> None:
    """Show one artifact: model binding, interventions, provenance, calibration winner."""
    from rich.console import Console

    from steerserve import artifacts as art

    out = Console(width=200, markup=False, highlight=False)
    try:
        path = art.resolve_artifact(ref, root)
        m = art.read_manifest(path)
    except art.ArtifactError as e:
        out.print(str(e), style="red")
        raise typer.Exit(1) from None
    b, fp = m.model, m.model.fingerprint
    out.print(f"{m.name}/{m.version}", style="bold", end="")
    out.print(f"  ({path})  created {m.created}, steerserve {m.steerserve_version}")
    if m.description:
        out.print(m.description)
    out.print(f"model: {b.architecture}, {b.num_layers} layers, hidden {b.hidden_size}")
    out.print(f"  source {b.source!r}, config {fp.config_sha256[:16]}…, embedding ", end="")
    out.print(f"{fp.embedding_sha256[:16]}…")
    out.print(f"layers: {m.layer_convention}")
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


@vectors_app.command("verify")
def vectors_verify(
    paths: list[Path] = typer.Argument(
        None, help="Artifact directories, or folders to search (default: all under ROOT)."
    ),
    model: Path | None = typer.Option(
        None, "--model", help="Also check the artifacts fit this local HF checkpoint."
    ),
    root: Path = typer.Option(Path("vectors"), help=_ROOT_HELP),
) -> None:
    """Verify artifacts (schema, checksums, shapes, NaN/Inf, layers, model); exit 1 on any failure."""
    from rich.console import Console

    from steerserve import artifacts as art

    out = Console(width=200, markup=False, highlight=False)
    dirs = [d for p in (paths or [root]) for d in (art.find_artifacts(p) or [p])]
    failed = 0
    try:
        expect = art.binding_for_model(model) if model is not None else None
    except art.ArtifactError as e:
        out.print(f"FAIL {e}", style="red")
        raise typer.Exit(1) from None
    for d in dirs:
        try:
            a = art.load_artifact(d, expect=expect)
            out.print(f"OK   {d}  {a.manifest.name}/{a.manifest.version}", style="green")
        except art.ArtifactError as e:
            failed += 1
            msg = str(e)
            out.print(f"FAIL {msg if str(d) in msg else f'{d}: {msg}'}", style="red")
    if failed:
        raise typer.Exit(1)


def main() -> None:
    app()
