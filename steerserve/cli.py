"""steerserve command line (typer)."""

from __future__ import annotations

from pathlib import Path

import typer

from steerserve import research_cli, tune_cli
from steerserve.engine.spec import DEFAULT_OPS_PER_LAYER
from steerserve.server.defaults import DRAIN_SECONDS, KEEP_ALIVE_SECONDS
from steerserve.server.steering import DEFAULT_MODE

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


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def serve(
    ctx: typer.Context,
    model: str = typer.Option(
        "default",
        envvar="STEERSERVE_MODEL",
        help="Model: a local HF checkpoint folder, or an embedded model: "
        "'qwen2.5-coder-1.5b-instruct' (chat; also 'default') or 'gemma-3-270m' (base).",
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
        "auto",
        envvar="STEERSERVE_DTYPE",
        help="auto, float32, bfloat16 or float16. auto: float32 on a CPU without native "
        "bfloat16 (avx512_bf16/amx_bf16; 3.3 vs 1.9 tokens/s measured), else vLLM's choice.",
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
    max_seqs_per_request: int = typer.Option(
        None,
        envvar="STEERSERVE_MAX_SEQS_PER_REQUEST",
        help="Most sequences one request may run: prompts x n, the A/B endpoint's two arms "
        "counted twice; more is refused (400). Default: half of --max-num-seqs, so one request "
        "never holds every seat and a later one starts at the engine's next step.",
        show_default=False,
    ),
    max_prompt_tokens_per_request: int = typer.Option(
        None,
        envvar="STEERSERVE_MAX_PROMPT_TOKENS_PER_REQUEST",
        help="Most prompt tokens one request may send (all its prompts, A/B arms twice); more is "
        "a 400. A request's prefill delays every request behind it. Default: 8 x "
        "--max-model-len.",
        show_default=False,
    ),
    max_scored_tokens_per_request: int = typer.Option(
        None,
        envvar="STEERSERVE_MAX_SCORED_TOKENS_PER_REQUEST",
        help="Most prompt tokens one request may score (echo with logprobs, prompt_logprobs); "
        "more is a 400. Each costs a vocabulary of logits. Default: 2^28 / the vocabulary size.",
        show_default=False,
    ),
    ops_per_layer: int = typer.Option(
        DEFAULT_OPS_PER_LAYER,
        envvar="STEERSERVE_OPS_PER_LAYER",
        help="Non-additive steering entries (ablate, replace, interp) one request may stack on "
        "one layer. 0 serves additive steering only and keeps their kernel out of compiled "
        "graphs (GPU), where it otherwise runs on every steerable layer at every step.",
    ),
    quantization: str = typer.Option(
        "auto",
        envvar="STEERSERVE_QUANTIZATION",
        help="auto, none or w4: serve the embedded chat model's 4-bit weight-only checkpoint "
        "(w4: computed in bfloat16, 1.5 GB less memory) or its full-precision one (none). auto: "
        "w4 only on a CPU where decode and bursts were both measured faster; so far none "
        "(AVX-512 without AMX: 1.26x slower decode; AMX: 1.8x faster decode, bursts 0.79x).",
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
        DEFAULT_MODE,
        envvar="STEERSERVE_STEERING",
        help="Default steering when a request does not say: off, on, or auto (on for "
        "non-English prompts). Off by default: no shipped vector is confirmed to mend recall.",
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
    drain_seconds: int = typer.Option(
        DRAIN_SECONDS,
        envvar="STEERSERVE_DRAIN_SECONDS",
        min=0,
        help="On SIGTERM/SIGINT (to the server or its whole process group): how long requests "
        "in flight may finish; a second signal stops at once.",
    ),
    keep_alive_seconds: int = typer.Option(
        KEEP_ALIVE_SECONDS,
        envvar="STEERSERVE_KEEP_ALIVE_SECONDS",
        min=1,
        help="How long an idle HTTP connection is kept open. Keep it above the idle timeout of "
        "any proxy or load balancer in front (often 60 s), so the server never closes a "
        "connection the proxy is reusing.",
    ),
    open_admin: bool = typer.Option(
        False,
        "--open-admin",
        envvar="STEERSERVE_OPEN_ADMIN",
        help="Allow POST /v1/steering/vectors without --api-key on a non-loopback --host "
        "(refused by default: anyone reaching the port could change every client's steering), "
        "and on loopback under any Host name (by default loopback names only: DNS rebinding).",
    ),
    ab_split: float = typer.Option(
        0.0,
        envvar="STEERSERVE_AB_SPLIT",
        help="A/B experiment: the share of users (OpenAI 'user' field, else the "
        "x-steerserve-subject header) steered, the same users every time; requests with "
        "'steering' keep theirs. 0: no experiment.",
    ),
    ab_name: str = typer.Option(
        "default",
        envvar="STEERSERVE_AB_NAME",
        help="A/B experiment name: part of the assignment hash (a new name reshuffles users).",
    ),
    ab_log: str = typer.Option(
        None,
        envvar="STEERSERVE_AB_LOG",
        help="A/B decision log (JSONL, appended): one line per answered enrolled request, and "
        "the scores POST /v1/steering/feedback joins to them. Read it with 'steerserve ab-report'.",
        show_default=False,
    ),
    ab_log_content: bool = typer.Option(
        False,
        "--ab-log-content",
        envvar="STEERSERVE_AB_LOG_CONTENT",
        help="Also log prompts and replies, in the log and the store (off by default: they may "
        "be personal data).",
    ),
    ab_store: str = typer.Option(
        None,
        envvar="STEERSERVE_AB_STORE",
        help="A/B experiment store every replica shares: sqlite:///PATH (one file, several "
        "processes on one host; sqlite:////an/absolute/path) or postgresql://USER@HOST:PORT/DB "
        "(replicas on many hosts; the password from the URL or libpq's PGPASSWORD/~/.pgpass, "
        "never logged). Decisions and feedback go there (created and migrated at start), "
        "feedback for any replica's answer is joined, and 'steerserve ab-report URL' reads "
        "it; --ab-log then is an export.",
        show_default=False,
    ),
    ab_store_spill: str = typer.Option(
        None,
        envvar="STEERSERVE_AB_STORE_SPILL",
        help="Folder where records still queued for an unreachable store are kept at shutdown "
        "and written at the next start (default: PATH-spill beside a SQLite store, else "
        "~/.local/state/steerserve/ab-spill).",
        show_default=False,
    ),
    tool_call_parser: str = typer.Option(
        "auto",
        envvar="STEERSERVE_TOOL_CALL_PARSER",
        help="vLLM's tool-call parser (hermes, llama3_json, mistral, ...): auto picks hermes for "
        "a chat template that writes <tool_call> tags (the default model's), none turns tools off.",
    ),
    enable_auto_tool_choice: bool = typer.Option(
        None,
        "--enable-auto-tool-choice/--no-auto-tool-choice",
        envvar="STEERSERVE_ENABLE_AUTO_TOOL_CHOICE",
        help="Let the model decide to call tools (tool_choice auto); default: on with a parser.",
        show_default=False,
    ),
    preset: list[str] = typer.Option(
        [],
        "--preset",
        help="NAME=SPEC: serve the steering SPEC (any 'steering' value, as JSON, or on/off/auto) "
        "as the model id <model>:NAME, chosen by 'model' alone (repeatable). The served artifact "
        "gives <model>:steering-on and <model>:steering-auto.",
    ),
    ab_preset: str = typer.Option(
        None,
        envvar="STEERSERVE_AB_PRESET",
        help="The preset the A/B experiment's steered arm serves (default: auto, or on).",
        show_default=False,
    ),
    chat_template: str = typer.Option(
        None,
        envvar="STEERSERVE_CHAT_TEMPLATE",
        help="A chat template (file or inline Jinja) instead of the model's own.",
        show_default=False,
    ),
) -> None:
    """Serve an OpenAI-compatible API (chat, completions, A/B) with per-request steering.
    Exits 1 when the engine fails to load or dies (for a supervisor to restart it).

    Any other `vllm serve` engine flag (--max-num-batched-tokens, --enable-chunked-prefill,
    --seed, --tokenizer, --structured-outputs-config ...) is passed to vLLM's engine as given."""
    from steerserve.server import options as so
    from steerserve.server.process import serve as run_server

    opts = so.ServeOptions(
        model, vectors_dir, host, dtype, max_model_len, kv_cache_bytes, gpu_memory_utilization,
        max_num_seqs, tensor_parallel_size, pipeline_parallel_size, distributed_executor_backend,
        enforce_eager, api_key, steering, served_model_name, log_level, drain_seconds,
        keep_alive_seconds, open_admin, ab_split, ab_name, ab_log, ab_log_content,
        max_seqs_per_request, ops_per_layer, quantization, tool_call_parser,
        enable_auto_tool_choice, chat_template, tuple(ctx.args), tuple(preset), ab_preset,
        ab_store, ab_store_spill, max_prompt_tokens_per_request, max_scored_tokens_per_request,
    )  # fmt: skip
    try:
        settings = so.settings(opts)
    except so.OptionError as e:
        raise typer.BadParameter(str(e), param_hint=e.param) from None
    raise typer.Exit(run_server(settings, port, log_level))


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
        help="The share of subjects the server steered (its --ab-split): the sample-ratio "
        "check compares it with the subjects seen per arm. Default: not checked.",
        show_default=False,
    ),
) -> None:
    """Who won the server's A/B experiment: per arm and detected language, requests, mean
    feedback score with its 95 % CI, the steered - unsteered difference, latency p50/p95.
    Exits 1 when records were skipped or dropped (the report says which)."""
    from steerserve.ab_report import EVERY, ignored_note, report, report_markdown, write_report
    from steerserve.server.ab_store import is_store_url, shown

    if not is_store_url(log) and not Path(log).is_file():
        raise typer.BadParameter(f"no such file: {log}", param_hint="LOG")
    if out is not None and out.exists() and not out.is_dir():
        raise typer.BadParameter(f"{out} exists and is not a folder", param_hint="--out")
    try:
        rep = report(log, min_n=min_scored, splits=None if split is None else {EVERY: split})
    except ValueError as e:  # a store that cannot be read: said in one line
        raise typer.BadParameter(str(e), param_hint="LOG") from None
    log = shown(log) if is_store_url(log) else log
    typer.echo(report_markdown(rep), nl=False)
    if out is not None:
        typer.echo(f"\nwrote {write_report(rep, out)} (+ report.json, report.png)")
    if note := ignored_note(rep):  # the report stands on the rest, but the log needs a look
        typer.echo(f"{log}: {note}", err=True)
        raise typer.Exit(1)


# --- vectors: inspect and verify artifacts ------------------------------------------------------

vectors_app = typer.Typer(
    help="Inspect, verify and gate steering-vector artifacts (vectors/<model>/<version>/).",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(vectors_app, name="vectors")
_ROOT_HELP = "Directory holding the artifacts (vectors/<model>/<version>/)."


@vectors_app.command("list")
def vectors_list(root: Path = typer.Option(Path("vectors"), help=_ROOT_HELP)) -> None:
    """List the artifacts under ROOT with their model and recommended layer/scale."""
    from steerserve import vectors_view

    raise typer.Exit(vectors_view.list_artifacts(root))


@vectors_app.command("show")
def vectors_show(
    ref: str = typer.Argument(
        help="NAME[/VERSION] under ROOT (latest version if omitted), or a path."
    ),
    root: Path = typer.Option(Path("vectors"), help=_ROOT_HELP),
) -> None:
    """Show one artifact: model binding, interventions, provenance, calibration winner."""
    from steerserve import vectors_view

    raise typer.Exit(vectors_view.show(ref, root))


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
    from steerserve import vectors_view

    raise typer.Exit(vectors_view.verify(paths or [], root, model))


@vectors_app.command("gate")
def vectors_gate(
    src: str = typer.Argument(help="NAME/VERSION under ROOT (or NAME: its newest), or a path."),
    version: str = typer.Option(..., "--version", help="The new version (must not exist)."),
    gates: Path = typer.Option(
        ..., "--gates", help='JSON: {"fr": {"multiplier": 0, "confirmation": {...}}, ...}.'
    ),
    root: Path = typer.Option(Path("vectors"), help=_ROOT_HELP),
    description: str = typer.Option(None, help="Default: the source's description."),
) -> None:
    """Publish SRC's vectors as a new VERSION whose 'auto' steers only the languages GATES lets
    through (a published version never changes); exit 1 on any refusal."""
    from steerserve import vectors_gate as vg

    raise typer.Exit(vg.gate(src, version, gates, root, description))


# --- research: extract, calibrate, eval, analyze, ... (option parsing in research_cli.py) ---------

for _name, _command in research_cli.COMMANDS:
    app.command(_name)(_command)
app.command("tune")(tune_cli.tune)


def main() -> None:
    app()
