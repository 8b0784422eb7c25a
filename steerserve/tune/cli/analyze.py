"""``steerserve lab analyze``: the diagnosis (logit lens, recall vs conversion failures)."""

from __future__ import annotations

from pathlib import Path

import typer

from steerserve.tune.cli import options as o

DATASET = typer.Option(
    None,
    help="JSONL {id, lang, prompt | messages, answers, answers_en, answers_zh?, sep?}; "
    "default: built-in split. answers_en is needed to classify failures, answers_zh to "
    "follow the Chinese answer; sep is what precedes the answer (default: ' ', '' for "
    "zh/ja, and for a chat what follows its template).",
)
FORM = typer.Option(
    "auto",
    help=o.FORM_HELP + " (built-in split; auto: the artifact's form, else by the model's name).",
)
SAMPLE = typer.Option(
    12, help="Seeded random N items per language (same positions in every language); 0: all."
)
ARTIFACT = typer.Option(
    None,
    help=o.ARTIFACT_HELP + " Without one, only '--arms unsteered' runs; anything else fails.",
    show_default=False,
)
ARMS = typer.Option(
    "",
    help="Comma-separated arms; default: unsteered, each intervention, both. Also: random, "
    "random_signs (same-norm controls).",
    show_default=False,
)
THRESHOLD = typer.Option(
    10, help="Rank (1 = top) the English answer must reach for a conversion failure."
)
WINDOW = typer.Option(
    "", help="Blocks LO,HI (inclusive) searched for the English answer; default: 2nd half."
)


def analyze(
    out: Path = typer.Option(
        Path("out/analysis"), help="Writes report.json, report.md and PNG figures here."
    ),
    model: str = o.MODEL,
    dataset: Path | None = DATASET,
    split: str = o.SPLIT,
    shots: int = o.SPLIT_SHOTS,
    form: str = FORM,
    sample: int = SAMPLE,
    seed: int = typer.Option(0, help="Seed of the --sample draw."),
    langs: str = o.LANGS,
    artifact: Path | None = ARTIFACT,
    vectors_dir: str = o.VECTORS_DIR,
    arms: str = ARMS,
    threshold: int = THRESHOLD,
    window: str = WINDOW,
    max_tokens: int = o.MAX_TOKENS,
    batch_size: int = typer.Option(8, help="Prompts per forward pass."),
    threads: int = o.TORCH_THREADS,
    device: str = typer.Option("cpu", help="torch device: cpu, cuda, ..."),
    dtype: str = o.TORCH_DTYPE,
) -> None:
    """Logit lens per language and recall vs conversion failures, with and without steering."""
    from steerserve.tune import analyze_run as an

    cfg = an.AnalyzeConfig(
        o.resolve_model(model), out, dataset, split, shots, form, sample, seed,
        None if langs == "all" else o.strs(langs), artifact, vectors_dir, o.strs(arms), threshold,
        tuple(o.ints(window)) if window else None,  # type: ignore[arg-type]
        max_tokens, batch_size, threads, device, dtype,
    )  # fmt: skip
    o.call_run(an.run, cfg)
