"""``steerserve tune``: the product path in one resumable command (``pipeline.run``)."""

from __future__ import annotations

from pathlib import Path

import typer

from steerserve.tune.cli import options as o

OUT = typer.Option(
    ...,
    help="Artifact to publish, ROOT/NAME/VERSION (e.g. vectors/llama-3.2-3b/v1); an existing "
    "version is refused before anything runs.",
    show_default=False,
)
WORK = typer.Option(
    None,
    help="Work folder of the stages' outputs (default out/tune/NAME-VERSION); running the "
    "same command again resumes there.",
    show_default=False,
)
LANGUAGES = typer.Option(
    "", help="Comma-separated languages (English, the guard, always added); default all."
)
DATASET = typer.Option(
    None,
    help="Your records (JSONL as eval --dataset, gold answers required): every third of each "
    "language selects, confirms and tests; default the built-in fact set.",
    show_default=False,
)
CANDIDATES = typer.Option(
    None, help="Candidates from 'steerserve lab extract' instead of the extract stage.",
    show_default=False,
)  # fmt: skip
SCALES = typer.Option(
    "0.05,0.15,0.5", help="Residual-norm units (log-spaced: models differ tenfold)."
)
MIN_EFFECT = typer.Option(
    0.3,
    help="Accuracy gain a confirmation must be able to see at 80 % power; a language with "
    "fewer items than that needs is closed.",
)
KV_CACHE = typer.Option(
    -1, "--kv-cache-memory-bytes", help=o.KV_HELP + " -1: sized for the machine."
)
STOP_AFTER = typer.Option(
    "", help="Stop after this stage; the same command later goes on from there."
)


def tune(
    model: str = typer.Option(..., help=o.MODEL_HELP, show_default=False),
    out: Path = OUT,
    work: Path = WORK,
    device: str = typer.Option("cpu", help="torch device of extraction and scoring: cpu, cuda."),
    dtype: str = typer.Option(
        "auto", help="transformers dtype (auto: float32 on CPU, bfloat16 on a GPU)."
    ),
    engine_dtype: str = typer.Option("auto", help="The test stage's " + o.ENGINE_DTYPE_HELP),
    form: str = typer.Option("auto", help=o.FORM_HELP + " (by the model's name)."),
    languages: str = LANGUAGES,
    dataset: Path | None = DATASET,
    candidates: Path | None = CANDIDATES,
    extract_per_lang: int = typer.Option(16, help="Train facts per language to extract from."),
    recall_sources: str = typer.Option("en,native,mixed", help="Recall variants to extract."),
    per_lang: int = typer.Option(40, help="Built-in: facts per language on each calibration half."),
    test_per_lang: int = typer.Option(
        0, help="Built-in test split: first N per language (0: all)."
    ),
    recall_layers: str = typer.Option("", help="e.g. 4,6,8 (default: 22-56 % of the depth)."),
    recall_scales: str = SCALES,
    translation_layers: str = typer.Option("", help="e.g. 12,14 (default: 67-89 % of the depth)."),
    translation_scales: str = SCALES,
    variants: str = o.VARIANTS,
    positions: str = o.POSITIONS,
    top_k: int = o.TOP_K,
    fine: str = o.FINE,
    alpha: float = typer.Option(0.05, help="Family-wise level of the per-language gates."),
    min_effect: float = MIN_EFFECT,
    max_en_drop: float = typer.Option(0.05, help="English accuracy the vectors may cost (guard)."),
    max_en_logp_drop: float = typer.Option(0.1, help="Nats of English log P(gold) they may cost."),
    batch_size: int = typer.Option(0, help="Scoring batch (0: sized for the machine)."),
    kv_cache_bytes: int = KV_CACHE,
    threads: int = o.TORCH_THREADS,
    stop_after: str = STOP_AFTER,
) -> None:
    """Extract, calibrate, confirm per language, gate, test once, publish: an artifact whose auto
    steers only the languages it was shown to help. The same command again resumes a stopped run."""
    from steerserve.tune.config import TuneConfig
    from steerserve.tune.gate import GateSettings
    from steerserve.tune.pipeline import run

    grid = o.sweep_grid(
        variants, recall_layers, recall_scales, translation_layers, translation_scales,
        positions, top_k, fine, max_en_logp_drop,
    )  # fmt: skip
    gate = GateSettings(alpha, min_effect, max_en_drop, max_en_logp_drop)
    cfg = TuneConfig(
        model, out, work, device, dtype, engine_dtype, form, o.strs(languages), dataset,
        candidates, extract_per_lang, o.strs(recall_sources), per_lang, test_per_lang, None,
        grid, gate, batch_size, kv_cache_bytes, 64, threads, stop_after,
    )  # fmt: skip
    o.call_run(run, cfg)
