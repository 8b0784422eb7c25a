"""``steerserve lab extract``: candidate vectors of both interventions from every layer."""

from __future__ import annotations

from pathlib import Path

import typer

from steerserve.tune.cli import options as o

OUT = typer.Option(
    Path("out/candidates.safetensors"), help="Candidates file (.safetensors + .json sidecar)."
)
FORM = typer.Option(
    "auto", help=o.FORM_HELP + " (chat for a model whose name ends in -instruct, -it, -chat)."
)
RECALL_SOURCES = typer.Option(
    "en,native,mixed",
    help="Recall variants to compute: demonstrations in English (en), in the query language "
    "(native), English ones before a query-language query (mixed); fewer = fewer prompts.",
)


def extract(
    out: Path = OUT,
    model: str = o.MODEL,
    device: str = typer.Option("cpu", help="torch device: cpu, cuda, cuda:1, ..."),
    dtype: str = o.TORCH_DTYPE,
    per_lang: int = typer.Option(16, help="Train facts per language (relations interleaved)."),
    recall_shots: int = typer.Option(5, help="Demonstrations in the recall task-vector prompts."),
    translation_shots: int = typer.Option(3, help="Demonstrations in the translation prompts."),
    batch_size: int = typer.Option(16, help="Prompts per forward pass."),
    threads: int = o.TORCH_THREADS,
    seed: int = typer.Option(0, help="Seed of the demonstration choice."),
    langs: str = o.LANGS,
    form: str = FORM,
    recall_sources: str = RECALL_SOURCES,
) -> None:
    """Extract per-layer candidate recall and translation vectors (all layers, last token)."""
    from steerserve.tune import extract as ex

    ext = ex.ExtractConfig(
        per_lang, recall_shots, translation_shots, seed, batch_size,
        o.facts_langs() if langs == "all" else o.strs(langs), form=form,
        recall_sources=o.strs(recall_sources),
    )  # fmt: skip
    cfg = ex.ExtractRun(model, o.resolve_model(model), out, device, dtype, threads, ext)
    o.call_run(ex.run, cfg)
