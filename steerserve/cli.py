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


# --- serve: the OpenAI-compatible server --------------------------------------------------------


def _default_vectors_dir() -> str:
    """``vectors/`` of the source tree or image (next to the package), else ./vectors."""
    here = Path(__file__).resolve().parent.parent / "vectors"
    return str(here if here.is_dir() else Path("vectors"))


def _resolve_model(model: str) -> Path:
    try:
        from steerserve.models import resolve_model
    except ImportError:  # older trees: a local checkpoint only
        if model == "default":
            raise typer.BadParameter("the embedded default model is not available") from None
        return Path(model)
    return Path(resolve_model(model))


@app.command()
def serve(
    model: str = typer.Option(
        "default",
        envvar="STEERSERVE_MODEL",
        help="Model: a local HF checkpoint folder, an id steerserve knows, or 'default' "
        "(the embedded Gemma 3 270M).",
    ),
    vectors_dir: str = typer.Option(
        None,
        envvar="STEERSERVE_VECTORS_DIR",
        help="Folder of steering artifacts; those made for this model are loaded at start "
        "(default: vectors/ of the source tree or image).",
        show_default=False,
    ),
    host: str = typer.Option("127.0.0.1", envvar="STEERSERVE_HOST", help="Address to bind."),
    port: int = typer.Option(8000, envvar="STEERSERVE_PORT", help="Port to bind."),
    dtype: str = typer.Option(
        "auto", envvar="STEERSERVE_DTYPE", help="auto, float32, bfloat16 or float16."
    ),
    max_model_len: int = typer.Option(
        2048, envvar="STEERSERVE_MAX_MODEL_LEN", help="Longest prompt + completion, in tokens."
    ),
    kv_cache_bytes: int = typer.Option(
        1 << 30,
        envvar="STEERSERVE_KV_CACHE_BYTES",
        help="KV cache size in bytes (needed on CPU); 0 lets vLLM size it on GPU from "
        "--gpu-memory-utilization.",
    ),
    gpu_memory_utilization: float = typer.Option(
        0.9,
        envvar="STEERSERVE_GPU_MEMORY_UTILIZATION",
        help="GPU memory share for vLLM (used when --kv-cache-bytes is 0).",
    ),
    max_num_seqs: int = typer.Option(
        64, envvar="STEERSERVE_MAX_NUM_SEQS", help="Most requests batched at once."
    ),
    tensor_parallel_size: int = typer.Option(
        1, envvar="STEERSERVE_TENSOR_PARALLEL_SIZE", help="GPUs per model replica (TP)."
    ),
    pipeline_parallel_size: int = typer.Option(
        1, envvar="STEERSERVE_PIPELINE_PARALLEL_SIZE", help="Pipeline stages (PP)."
    ),
    distributed_executor_backend: str = typer.Option(
        None,
        envvar="STEERSERVE_DISTRIBUTED_EXECUTOR_BACKEND",
        help="vLLM executor: mp (default) or ray (multi-node).",
    ),
    enforce_eager: bool = typer.Option(
        None,
        "--enforce-eager/--compile",
        envvar="STEERSERVE_ENFORCE_EAGER",
        help="Eager PyTorch or torch.compile + graphs (default: eager on CPU, compile on GPU).",
        show_default=False,
    ),
    api_key: str = typer.Option(
        None,
        envvar="STEERSERVE_API_KEY",
        help="Require 'Authorization: Bearer KEY' on /v1/* (default: no auth).",
    ),
    steering: str = typer.Option(
        "auto",
        envvar="STEERSERVE_STEERING",
        help="Default steering when a request does not say: off, on, or auto (on for "
        "non-English prompts).",
    ),
    served_model_name: str = typer.Option(
        None,
        envvar="STEERSERVE_SERVED_MODEL_NAME",
        help="Name clients pass as 'model' (default: the model's folder name).",
        show_default=False,
    ),
    log_level: str = typer.Option(
        "info", envvar="STEERSERVE_LOG_LEVEL", help="debug, info, warning or error."
    ),
) -> None:
    """Serve an OpenAI-compatible API (chat, completions, A/B) with per-request steering."""
    import logging

    import uvicorn

    from steerserve.engine.api import EngineConfig
    from steerserve.server.app import ServerSettings, create_app

    if steering not in ("off", "on", "auto"):
        raise typer.BadParameter(f"--steering must be off, on or auto, not {steering!r}")
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    model_dir = _resolve_model(model)
    if enforce_eager is None:
        import torch

        enforce_eager = not torch.cuda.is_available()
    cfg = EngineConfig(
        model=str(model_dir),
        dtype=dtype,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        kv_cache_memory_bytes=kv_cache_bytes or None,
        gpu_memory_utilization=None if kv_cache_bytes else gpu_memory_utilization,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        distributed_executor_backend=distributed_executor_backend,
        enforce_eager=enforce_eager,
    )
    settings = ServerSettings(
        engine=cfg,
        vectors_dir=vectors_dir or _default_vectors_dir(),
        served_model_name=served_model_name,
        api_key=api_key or None,
        steering=steering,
        exit_on_load_failure=True,
    )
    server_app = create_app(settings)
    uvicorn.run(
        server_app,
        host=host,
        port=port,
        log_level=log_level.lower(),
        timeout_graceful_shutdown=300,
    )
    if server_app.state.steer.load_error is not None:
        raise typer.Exit(1)


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
