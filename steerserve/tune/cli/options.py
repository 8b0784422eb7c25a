"""What the commands share: option declarations, list parsers and how a refusal is said;
declared once, the help of calibrate and tune cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from steerserve.engine.defaults import RESEARCH_KV_CACHE_MEMORY_BYTES

MODEL_HELP = (
    "Local HF checkpoint folder, or an embedded model: 'default' (Qwen2.5-Coder-1.5B-Instruct, "
    "chat) or 'gemma-3-270m' (base, few-shot completion)."
)
ENGINE_DTYPE_HELP = "vLLM dtype: auto, float32, bfloat16 or float16."
KV_HELP = "vLLM KV cache bytes (CPU needs one); 0 lets vLLM size it on a GPU."
THREADS_HELP = "CPU cores for vLLM's threads, e.g. '0' or '0-1' (CPU only; default: vLLM's)."
FORM_HELP = (
    "Prompt form: completion (few-shot text, base models), chat (messages rendered by the model's "
    "chat template, as the server renders them) or auto"
)
ARTIFACT_HELP = (
    "Artifact directory (manifest + tensors); default: the artifact the server's 'auto' policy "
    "would serve for --model from --vectors-dir."
)
MAX_TOKENS_HELP = (
    "Greedy tokens per reply (a completion stops at a newline, a chat reply at EOS or a blank "
    "line; default 8 for completions, 64 for chat replies, which restate the question)."
)

MODEL = typer.Option("default", help=MODEL_HELP)
MAX_TOKENS = typer.Option(0, help=MAX_TOKENS_HELP, show_default=False)
KV_CACHE = typer.Option(RESEARCH_KV_CACHE_MEMORY_BYTES, "--kv-cache-memory-bytes", help=KV_HELP)
MAX_NUM_SEQS = typer.Option(64, help="Most requests batched at once.")
TORCH_THREADS = typer.Option(0, help="torch CPU threads (0: torch's default).")
TORCH_DTYPE = typer.Option("float32", help="torch dtype: float32, bfloat16 or float16.")
LANGS = typer.Option("all", help="Comma-separated languages, or 'all'.")
VECTORS_DIR = typer.Option(
    None, help="Where the default artifact is looked up (default: the server's vectors/).",
    show_default=False,
)  # fmt: skip
SPLIT = typer.Option("test", help="Built-in split: test (held out) or calib.")
SPLIT_SHOTS = typer.Option(
    None,
    help="Built-in split: demonstrations per prompt (default: 3 for completion, 0 for chat).",
    show_default=False,
)
# the sweep's grid, as calibrate and tune both take it
VARIANTS = typer.Option(
    "recall.native.diff,recall.mixed.diff,recall.en.diff", help="Recall candidates to sweep."
)
POSITIONS = typer.Option(
    "last_prompt_and_generated", help="First is swept; others tried on the winner."
)
TOP_K = typer.Option(3, help="Best of each vector carried into the joint stage.")
FINE = typer.Option("0.5,1.5", help="Scale factors tried around the joint winner.")


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def strs(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def part(text: str) -> tuple[int, int]:
    """``K/N`` -> (K, N), 0 <= K < N; a usage error otherwise."""
    try:
        k, n = (int(x) for x in text.split("/"))
        if not 0 <= k < n:
            raise ValueError
    except ValueError:
        raise typer.BadParameter(
            f"{text!r} is not K/N with 0 <= K < N", param_hint="--part"
        ) from None
    return k, n


def resolve_model(model: str) -> Path:
    from steerserve.models import resolve_model

    try:
        return Path(resolve_model(model))
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--model") from None


def facts_langs() -> tuple[str, ...]:
    from steerserve.tune.facts import LANGS

    return LANGS


def sweep_grid(
    variants: str,
    recall_layers: str,
    recall_scales: str,
    translation_layers: str,
    translation_scales: str,
    positions: str,
    top_k: int,
    fine: str,
    max_en_logp_drop: float,
    **more: Any,
) -> dict[str, Any]:
    """The sweep's options as ``calibrate.Grid.for_layers`` keywords; layers left empty are
    placed by the model's depth."""
    grid: dict[str, Any] = dict(
        recall_variants=strs(variants), recall_scales=floats(recall_scales),
        translation_scales=floats(translation_scales), positions=strs(positions), top_k=top_k,
        fine_factors=floats(fine), max_en_logp_drop=max_en_logp_drop, **more,
    )  # fmt: skip
    if recall_layers:
        grid["recall_layers"] = ints(recall_layers)
    if translation_layers:
        grid["translation_layers"] = ints(translation_layers)
    return grid


def call_run(run: Callable[..., Any], cfg: Any) -> Any:
    """Call a stage's ``run(config)`` with its refusals said as a command line says them: a
    ``ConfigError`` is a usage error naming its option, a ``RunError`` is ``error: ...``, exit 1."""
    from steerserve.tune.runs import ConfigError, RunError

    try:
        return run(cfg, log=typer.echo)
    except ConfigError as e:
        raise typer.BadParameter(str(e), param_hint=e.param) from None
    except RunError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
