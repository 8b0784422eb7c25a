"""The research commands' options (extract, calibrate, eval, analyze): each parses its options
into its module's config and calls its ``run``; ``cli.py`` registers them under ``steerserve
lab`` (see :data:`COMMANDS`).

Why a file of its own: option declarations with their help texts are most of a command's lines;
kept apart from the server's and the artifacts' commands, each file stays one screenful per
command and no research logic hides in either.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from steerserve.engine.defaults import RESEARCH_KV_CACHE_MEMORY_BYTES


def _resolve_model(model: str) -> Path:
    from steerserve.models import resolve_model

    try:
        return Path(resolve_model(model))
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--model") from None


# --- extract / calibrate / eval: the two interventions, calibrated and evaluated --------------

MODEL_HELP = (
    "Local HF checkpoint folder, or an embedded model: 'default' (Qwen2.5-Coder-1.5B-Instruct, "
    "chat) or 'gemma-3-270m' (base, few-shot completion)."
)
ENGINE_DTYPE_HELP = "vLLM dtype: auto, float32, bfloat16 or float16."
KV_HELP = "vLLM KV cache bytes (CPU needs one); 0 lets vLLM size it on a GPU."
_THREADS_HELP = "CPU cores for vLLM's threads, e.g. '0' or '0-1' (CPU only; default: vLLM's)."
FORM_HELP = (
    "Prompt form: completion (few-shot text, base models), chat (messages rendered by the model's "
    "chat template, as the server renders them) or auto"
)
_MAX_TOKENS_HELP = (
    "Greedy tokens per reply (a completion stops at a newline, a chat reply at EOS or a blank "
    "line; default 8 for completions, 64 for chat replies, which restate the question)."
)


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def strs(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


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
    """The sweep's options as ``calibrate.Grid.for_layers`` keywords (calibrate and tune take
    the same ones); layers left empty are placed by the model's depth."""
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


def extract(
    out: Path = typer.Option(
        Path("out/candidates.safetensors"), help="Candidates file (.safetensors + .json sidecar)."
    ),
    model: str = typer.Option("default", help=MODEL_HELP),
    device: str = typer.Option("cpu", help="torch device: cpu, cuda, cuda:1, ..."),
    dtype: str = typer.Option("float32", help="torch dtype: float32, bfloat16 or float16."),
    per_lang: int = typer.Option(16, help="Train facts per language (relations interleaved)."),
    recall_shots: int = typer.Option(5, help="Demonstrations in the recall task-vector prompts."),
    translation_shots: int = typer.Option(3, help="Demonstrations in the translation prompts."),
    batch_size: int = typer.Option(16, help="Prompts per forward pass."),
    threads: int = typer.Option(0, help="torch CPU threads (0: torch's default)."),
    seed: int = typer.Option(0, help="Seed of the demonstration choice."),
    langs: str = typer.Option("all", help="Comma-separated languages, or 'all'."),
    form: str = typer.Option(
        "auto", help=FORM_HELP + " (chat for a model whose name ends in -instruct, -it, -chat)."
    ),
    recall_sources: str = typer.Option(
        "en,native,mixed",
        help="Recall variants to compute: demonstrations in English (en), in the query language "
        "(native), English ones before a query-language query (mixed); fewer = fewer prompts.",
    ),
) -> None:
    """Extract per-layer candidate recall and translation vectors (all layers, last token)."""
    from steerserve.research import extract as ex

    ext = ex.ExtractConfig(
        per_lang, recall_shots, translation_shots, seed, batch_size,
        _facts_langs() if langs == "all" else strs(langs), form=form,
        recall_sources=strs(recall_sources),
    )  # fmt: skip
    cfg = ex.ExtractRun(model, _resolve_model(model), out, device, dtype, threads, ext)
    call_run(ex.run, cfg)


def calibrate(
    candidates: Path = typer.Option(
        Path("out/candidates.safetensors"), help="Output of 'steerserve lab extract'."
    ),
    out: Path = typer.Option(
        ...,
        help="Artifact directory to write, ROOT/NAME/VERSION (e.g. vectors/gemma-3-270m/v4); "
        "NAME and VERSION are the artifact's.",
        show_default=False,
    ),
    model: str = typer.Option("default", help=MODEL_HELP),
    objective: str = typer.Option(
        "logp",
        help="logp: choose by the paired change in teacher-forced log P(gold answer), "
        "non-English, on one half of the calibration facts, then re-check the winner on the "
        "other half (always; scored in transformers, no vLLM engine). accuracy: choose by greedy "
        "accuracy through the vLLM engine (re-checked only with --holdout); on a few hundred "
        "items it picks the luckiest of the settings.",
    ),
    per_lang: int = typer.Option(10, help="Calibration facts per non-English language."),
    en_items: int = typer.Option(30, help="English calibration facts (the <=1 pt guard)."),
    shots: int = typer.Option(
        None,
        help="Demonstrations in the calibration prompts (default: 3 for completion, 0 for chat).",
        show_default=False,
    ),
    max_tokens: int = typer.Option(0, help=_MAX_TOKENS_HELP, show_default=False),
    form: str = typer.Option(
        "auto", help=FORM_HELP + " (the form the candidates were extracted in)."
    ),
    dataset: Path | None = typer.Option(
        None,
        help="JSONL records of one form (see eval --dataset) instead of the built-in "
        "calibration split; with --holdout or --objective logp, every other record of each "
        "language is held out.",
        show_default=False,
    ),
    variants: str = typer.Option(
        "recall.native.diff,recall.mixed.diff,recall.en.diff", help="Recall candidates to sweep."
    ),
    recall_layers: str = typer.Option(
        "", help="e.g. 4,6,8,10 (default: 22-56 % of the depth, 4 blocks)."
    ),
    recall_scales: str = typer.Option("0.25,0.5", help="Residual-norm units."),
    translation_layers: str = typer.Option(
        "", help="e.g. 12,14,15,16 (default: 67-89 % of the depth, 4 blocks)."
    ),
    translation_scales: str = typer.Option("0.25,0.5", help="Residual-norm units."),
    positions: str = typer.Option(
        "last_prompt_and_generated", help="First is swept; others tried on the winner."
    ),
    top_k: int = typer.Option(3, help="Best of each vector carried into the joint stage."),
    fine: str = typer.Option("0.5,1.5", help="Scale factors tried around the joint winner."),
    max_en_drop: float = typer.Option(
        0.01,
        help="Allowed English accuracy drop (0..1): the accuracy objective's guard; with logp, "
        "the held-out check's.",
    ),
    max_en_logp_drop: float = typer.Option(
        0.1,
        help="logp only: nats of English mean log P(gold) the chosen pair may cost, on the "
        "selection half and again on the held-out half.",
    ),
    dtype: str = typer.Option(
        "auto",
        help=ENGINE_DTYPE_HELP + " With logp, the transformers dtype (auto: float32 on CPU, "
        "bfloat16 on a GPU).",
    ),
    device: str = typer.Option(
        "cpu", help="logp only: torch device of the scoring model (cpu, cuda, cuda:1, ...)."
    ),
    batch_size: int = typer.Option(64, help="logp only: items per forward pass."),
    kv_cache_bytes: int = typer.Option(
        RESEARCH_KV_CACHE_MEMORY_BYTES, "--kv-cache-memory-bytes", help=KV_HELP
    ),
    max_num_seqs: int = typer.Option(64, help="Most requests batched at once."),
    cpu_threads: str = typer.Option(
        "", help=_THREADS_HELP + " With logp, the number of cores listed is torch's thread count."
    ),
    holdout: int = typer.Option(
        0,
        help="Calibration facts per language (English included) on which the chosen pair is "
        "re-checked against the unsteered arm (0: no check with accuracy; with logp, the same "
        "numbers as the selection, --per-lang and --en-items). With a check, the sweep draws from "
        "every other fact and the check from the rest, so the two sets never share a fact.",
    ),
    overwrite: bool = typer.Option(False, help="Replace an existing artifact."),
    summary_dir: Path = typer.Option(
        Path("docs/results"), help="Where calibration.md / calibration.json go."
    ),
) -> None:
    """Sweep layer x scale x variant jointly on the calibration split; save the artifact.

    With --objective logp (the default) the winner is chosen on one half of the calibration
    facts and re-checked on the other; the artifact records whether it confirmed."""
    from steerserve.research import calibrate_run as run

    grid = sweep_grid(
        variants, recall_layers, recall_scales, translation_layers, translation_scales,
        positions, top_k, fine, max_en_logp_drop, max_en_drop=max_en_drop, objective=objective,
    )  # fmt: skip
    cfg = run.CalibrateConfig(
        candidates, out, model, objective, per_lang, en_items, shots, max_tokens, form, dataset,
        grid, dtype, device, batch_size, kv_cache_bytes, max_num_seqs, cpu_threads, 0, holdout,
        overwrite, summary_dir,
    )  # fmt: skip
    call_run(run.run, cfg)


_ARTIFACT_HELP = (
    "Artifact directory (manifest + tensors); default: the artifact the server's 'auto' policy "
    "would serve for --model from --vectors-dir."
)
_VECTORS_HELP = "Where the default artifact is looked up (default: the server's vectors/)."


def eval_cmd(
    artifact: Path | None = typer.Option(None, help=_ARTIFACT_HELP, show_default=False),
    vectors_dir: str = typer.Option(None, help=_VECTORS_HELP, show_default=False),
    out: Path = typer.Option(Path("out/eval"), help="Writes report.json, report.md, accuracy.png."),
    model: str = typer.Option("default", help=MODEL_HELP),
    dataset: Path | None = typer.Option(
        None,
        help="JSONL {id, lang, prompt | messages, answers, answers_en?, answers_zh?} (completion "
        "or chat records, one form per file); default: built-in test split.",
    ),
    arms: str = typer.Option(
        "",
        help="Comma-separated arms; default all: unsteered, each intervention, both (all of "
        "them), random, random_signs (same-norm controls). Each chunk of records runs them in "
        "this order; the report is rewritten after each chunk.",
        show_default=False,
    ),
    limit_per_lang: int = typer.Option(0, help="Built-in split: first N facts per language."),
    part: str = typer.Option(
        "0/1",
        help="Built-in split: K/N keeps every N-th fact of each relation from the K-th on "
        "(0/3: the test third; 0/2 and 1/2: two disjoint halves).",
    ),
    shots: int = typer.Option(
        None,
        help="Built-in split: demonstrations per prompt (default: 3 for completion, 0 for chat).",
        show_default=False,
    ),
    split: str = typer.Option("test", help="Built-in split: test (held out) or calib."),
    form: str = typer.Option(
        "auto",
        help=FORM_HELP + " (built-in split; auto: the form the artifact was calibrated in).",
    ),
    max_tokens: int = typer.Option(0, help=_MAX_TOKENS_HELP, show_default=False),
    max_cut_share: float = typer.Option(
        0.02,
        help="Stop (exit 1) when more than this share of replies was cut by --max-tokens before "
        "the answer ended; a budget that cuts answers makes the accuracies wrong.",
    ),
    plan: Path | None = typer.Option(
        None,
        help="The test's plan, declared before it runs (items, arms, metric, smallest detectable "
        "effect): copied into the report; a finished report that holds a plan is never "
        "overwritten, so a test runs once.",
        show_default=False,
    ),
    dtype: str = typer.Option("auto", help=ENGINE_DTYPE_HELP),
    kv_cache_bytes: int = typer.Option(
        RESEARCH_KV_CACHE_MEMORY_BYTES, "--kv-cache-memory-bytes", help=KV_HELP
    ),
    max_num_seqs: int = typer.Option(64, help="Most requests batched at once."),
    cpu_threads: str = typer.Option("", help=_THREADS_HELP),
) -> None:
    """Evaluate an artifact's arms (unsteered, each intervention, both, controls) through vLLM;
    writes report.json/md, accuracy.png and every reply (replies.jsonl)."""
    from steerserve.research import evaluate_run as ev
    from steerserve.research.replies import BudgetError

    cfg = ev.EvalConfig(
        _resolve_model(model), out, artifact, vectors_dir, dataset, strs(arms), limit_per_lang,
        _part(part), shots, split, form, max_tokens, max_cut_share, plan, dtype, kv_cache_bytes,
        max_num_seqs, cpu_threads,
    )  # fmt: skip
    try:
        call_run(ev.run, cfg)
    except BudgetError as e:
        typer.echo(f"error: {e} (report and replies so far in {out})", err=True)
        raise typer.Exit(1) from None


def call_run(run: Callable[..., Any], cfg: Any) -> Any:
    """Call a research ``run(config)``, its refusals said as a command line says them: a
    ``ConfigError`` is a usage error naming its option, a ``RunError`` is ``error: ...`` and
    exit status 1."""
    from steerserve.research.runs import ConfigError, RunError

    try:
        return run(cfg, log=typer.echo)
    except ConfigError as e:
        raise typer.BadParameter(str(e), param_hint=e.param) from None
    except RunError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None


def _part(text: str) -> tuple[int, int]:
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


def analyze(
    out: Path = typer.Option(
        Path("out/analysis"), help="Writes report.json, report.md and PNG figures here."
    ),
    model: str = typer.Option("default", help=MODEL_HELP),
    dataset: Path | None = typer.Option(
        None,
        help="JSONL {id, lang, prompt | messages, answers, answers_en, answers_zh?, sep?}; "
        "default: built-in split. answers_en is needed to classify failures, answers_zh to "
        "follow the Chinese answer; sep is what precedes the answer (default: ' ', '' for "
        "zh/ja, and for a chat what follows its template).",
    ),
    split: str = typer.Option("test", help="Built-in split: test (held out) or calib."),
    shots: int = typer.Option(
        None,
        help="Built-in split: demonstrations per prompt (default: 3 for completion, 0 for chat).",
        show_default=False,
    ),
    form: str = typer.Option(
        "auto",
        help=FORM_HELP + " (built-in split; auto: the artifact's form, else by the model's name).",
    ),
    sample: int = typer.Option(
        12, help="Seeded random N items per language (same positions in every language); 0: all."
    ),
    seed: int = typer.Option(0, help="Seed of the --sample draw."),
    langs: str = typer.Option("all", help="Comma-separated languages, or 'all'."),
    artifact: Path | None = typer.Option(
        None,
        help=_ARTIFACT_HELP + " Without one, only '--arms unsteered' runs; anything else fails.",
        show_default=False,
    ),
    vectors_dir: str = typer.Option(None, help=_VECTORS_HELP, show_default=False),
    arms: str = typer.Option(
        "",
        help="Comma-separated arms; default: unsteered, each intervention, both. Also: random, "
        "random_signs (same-norm controls).",
        show_default=False,
    ),
    threshold: int = typer.Option(
        10, help="Rank (1 = top) the English answer must reach for a conversion failure."
    ),
    window: str = typer.Option(
        "", help="Blocks LO,HI (inclusive) searched for the English answer; default: 2nd half."
    ),
    max_tokens: int = typer.Option(0, help=_MAX_TOKENS_HELP, show_default=False),
    batch_size: int = typer.Option(8, help="Prompts per forward pass."),
    threads: int = typer.Option(0, help="torch CPU threads (0: torch's default)."),
    device: str = typer.Option("cpu", help="torch device: cpu, cuda, ..."),
    dtype: str = typer.Option("float32", help="torch dtype: float32, bfloat16 or float16."),
) -> None:
    """Logit lens per language and recall vs conversion failures, with and without steering."""
    from steerserve.research import analyze_run as an

    cfg = an.AnalyzeConfig(
        _resolve_model(model), out, dataset, split, shots, form, sample, seed,
        None if langs == "all" else strs(langs), artifact, vectors_dir, strs(arms), threshold,
        tuple(ints(window)) if window else None,  # type: ignore[arg-type]
        max_tokens, batch_size, threads, device, dtype,
    )  # fmt: skip
    call_run(an.run, cfg)


def _facts_langs() -> tuple[str, ...]:
    from steerserve.research.facts import LANGS

    return LANGS


#: (command name, function) in the order ``steerserve --help`` lists them.
COMMANDS: tuple[tuple[str, Callable[..., None]], ...] = (
    ("extract", extract),
    ("calibrate", calibrate),
    ("eval", eval_cmd),
    ("analyze", analyze),
)
