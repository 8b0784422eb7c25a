"""``steerserve lab eval``: an artifact's arms through the vLLM engine, every reply kept."""

from __future__ import annotations

from pathlib import Path

import typer

from steerserve.tune.cli import options as o

DATASET = typer.Option(
    None,
    help="JSONL {id, lang, prompt | messages, answers, answers_en?, answers_zh?} (completion "
    "or chat records, one form per file); default: built-in test split.",
)
ARMS = typer.Option(
    "",
    help="Comma-separated arms; default all: unsteered, each intervention, both (all of "
    "them), random, random_signs (same-norm controls). Each chunk of records runs them in "
    "this order; the report is rewritten after each chunk.",
    show_default=False,
)
PART = typer.Option(
    "0/1",
    help="Built-in split: K/N keeps every N-th fact of each relation from the K-th on "
    "(0/3: the test third; 0/2 and 1/2: two disjoint halves).",
)
FORM = typer.Option(
    "auto", help=o.FORM_HELP + " (built-in split; auto: the form the artifact was calibrated in)."
)
MAX_CUT_SHARE = typer.Option(
    0.02,
    help="Stop (exit 1) when more than this share of replies was cut by --max-tokens before "
    "the answer ended; a budget that cuts answers makes the accuracies wrong.",
)
PLAN = typer.Option(
    None,
    help="The test's plan, declared before it runs (items, arms, metric, smallest detectable "
    "effect): copied into the report; a finished report that holds a plan is never "
    "overwritten, so a test runs once.",
    show_default=False,
)


def eval_cmd(
    artifact: Path | None = typer.Option(None, help=o.ARTIFACT_HELP, show_default=False),
    vectors_dir: str = o.VECTORS_DIR,
    out: Path = typer.Option(Path("out/eval"), help="Writes report.json, report.md, accuracy.png."),
    model: str = o.MODEL,
    dataset: Path | None = DATASET,
    arms: str = ARMS,
    limit_per_lang: int = typer.Option(0, help="Built-in split: first N facts per language."),
    part: str = PART,
    shots: int = o.SPLIT_SHOTS,
    split: str = o.SPLIT,
    form: str = FORM,
    max_tokens: int = o.MAX_TOKENS,
    max_cut_share: float = MAX_CUT_SHARE,
    plan: Path | None = PLAN,
    dtype: str = typer.Option("auto", help=o.ENGINE_DTYPE_HELP),
    kv_cache_bytes: int = o.KV_CACHE,
    max_num_seqs: int = o.MAX_NUM_SEQS,
    cpu_threads: str = typer.Option("", help=o.THREADS_HELP),
) -> None:
    """Evaluate an artifact's arms (unsteered, each intervention, both, controls) through vLLM;
    writes report.json/md, accuracy.png and every reply (replies.jsonl)."""
    from steerserve.tune import evaluate_run as ev
    from steerserve.tune.replies import BudgetError

    cfg = ev.EvalConfig(
        o.resolve_model(model), out, artifact, vectors_dir, dataset, o.strs(arms), limit_per_lang,
        o.part(part), shots, split, form, max_tokens, max_cut_share, plan, dtype, kv_cache_bytes,
        max_num_seqs, cpu_threads,
    )  # fmt: skip
    try:
        o.call_run(ev.run, cfg)
    except BudgetError as e:
        typer.echo(f"error: {e} (report and replies so far in {out})", err=True)
        raise typer.Exit(1) from None
