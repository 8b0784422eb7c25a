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

    from steerserve import artifacts as art

    table = Table("name", "version", "model", "interventions", "layer / scale / positions")
    for p in art.find_artifacts(root):
        try:
            m = art.read_manifest(p)
        except art.ArtifactError as e:
            table.add_row(str(p.relative_to(root)), "", "", f"[red]invalid: {e}[/red]", "")
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

    out = Console(width=200)
    try:
        path = art.resolve_artifact(ref, root)
        m = art.read_manifest(path)
    except art.ArtifactError as e:
        out.print(f"[red]{e}[/red]")
        raise typer.Exit(1) from None
    b = m.model
    out.print(
        f"[bold]{m.name}/{m.version}[/bold]  ({path})  created {m.created}, steerserve {m.steerserve_version}"
    )
    if m.description:
        out.print(m.description)
    out.print(
        f"model: {b.architecture}, {b.num_layers} layers, hidden {b.hidden_size}, source {b.source!r}"
    )
    out.print(
        f"  config {b.fingerprint.config_sha256[:16]}…  embedding {b.fingerprint.embedding_sha256[:16]}…"
    )
    out.print(f"layers: {m.layer_convention}")
    for iv in m.interventions:
        out.print(
            f"[bold]{m.vector_name(iv)}[/bold]: layer {iv.layer}, scale {iv.scale:g}, "
            f"positions {iv.positions}, norm {iv.norm or 0:.4g}, sha256 {iv.sha256[:16]}…"
        )
        if iv.provenance:
            out.print("  provenance: " + ", ".join(f"{k}={v}" for k, v in iv.provenance.items()))
        cal = iv.calibration or {}
        if cal:
            rows = next((len(v) for v in cal.values() if isinstance(v, list)), 0)
            out.print(
                f"  calibration: objective {cal.get('objective', '?')}; chosen {cal.get('chosen', '?')}; {rows} sweep rows"
            )


@vectors_app.command("verify")
def vectors_verify(
    paths: list[Path] = typer.Argument(
        None, help="Artifact directories (default: all under ROOT)."
    ),
    model: Path | None = typer.Option(
        None, "--model", help="Also check the artifacts fit this local HF checkpoint."
    ),
    root: Path = typer.Option(Path("vectors"), help=_ROOT_HELP),
) -> None:
    """Verify artifacts (schema, checksums, shapes, finiteness, layers, model); exit 1 on any failure."""
    from rich.console import Console

    from steerserve import artifacts as art

    out = Console(width=200)
    dirs = [d for p in (paths or [root]) for d in (art.find_artifacts(p) or [p])]
    expect = art.binding_for_model(model) if model is not None else None
    failed = 0
    for d in dirs:
        try:
            a = art.load_artifact(d, expect=expect)
            out.print(f"[green]OK[/green]   {d}  {a.manifest.name}/{a.manifest.version}")
        except art.ArtifactError as e:
            failed += 1
            out.print(f"[red]FAIL[/red] {d}: {e}")
    if failed:
        raise typer.Exit(1)


def main() -> None:
    app()
