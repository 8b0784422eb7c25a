"""``steerserve lab calibrate``: the layer x scale x variant sweep that writes an artifact."""

from __future__ import annotations

from pathlib import Path

import typer

from steerserve.tune.cli import options as o

CANDIDATES = typer.Option(
    Path("out/candidates.safetensors"), help="Output of 'steerserve lab extract'."
)
OUT = typer.Option(
    ...,
    help="Artifact directory to write, ROOT/NAME/VERSION (e.g. vectors/gemma-3-270m/v4); "
    "NAME and VERSION are the artifact's.",
    show_default=False,
)
OBJECTIVE = typer.Option(
    "logp",
    help="logp: choose by the paired change in teacher-forced log P(gold answer), "
    "non-English, on one half of the calibration facts, then re-check the winner on the "
    "other half (always; scored in transformers, no vLLM engine). accuracy: choose by greedy "
    "accuracy through the vLLM engine (re-checked only with --holdout); on a few hundred "
    "items it picks the luckiest of the settings.",
)
SHOTS = typer.Option(
    None,
    help="Demonstrations in the calibration prompts (default: 3 for completion, 0 for chat).",
    show_default=False,
)
FORM = typer.Option("auto", help=o.FORM_HELP + " (the form the candidates were extracted in).")
DATASET = typer.Option(
    None,
    help="JSONL records of one form (see eval --dataset) instead of the built-in "
    "calibration split; with --holdout or --objective logp, every other record of each "
    "language is held out.",
    show_default=False,
)
RECALL_LAYERS = typer.Option("", help="e.g. 4,6,8,10 (default: 22-56 % of the depth, 4 blocks).")
TRANSLATION_LAYERS = typer.Option(
    "", help="e.g. 12,14,15,16 (default: 67-89 % of the depth, 4 blocks)."
)
SCALES = typer.Option("0.25,0.5", help="Residual-norm units.")
MAX_EN_DROP = typer.Option(
    0.01,
    help="Allowed English accuracy drop (0..1): the accuracy objective's guard; with logp, "
    "the held-out check's.",
)
MAX_EN_LOGP_DROP = typer.Option(
    0.1,
    help="logp only: nats of English mean log P(gold) the chosen pair may cost, on the "
    "selection half and again on the held-out half.",
)
DTYPE = typer.Option(
    "auto",
    help=o.ENGINE_DTYPE_HELP + " With logp, the transformers dtype (auto: float32 on CPU, "
    "bfloat16 on a GPU).",
)
DEVICE = typer.Option(
    "cpu", help="logp only: torch device of the scoring model (cpu, cuda, cuda:1, ...)."
)
CPU_THREADS = typer.Option(
    "", help=o.THREADS_HELP + " With logp, the number of cores listed is torch's thread count."
)
HOLDOUT = typer.Option(
    0,
    help="Calibration facts per language (English included) on which the chosen pair is "
    "re-checked against the unsteered arm (0: no check with accuracy; with logp, the same "
    "numbers as the selection, --per-lang and --en-items). With a check, the sweep draws from "
    "every other fact and the check from the rest, so the two sets never share a fact.",
)


def calibrate(
    candidates: Path = CANDIDATES,
    out: Path = OUT,
    model: str = o.MODEL,
    objective: str = OBJECTIVE,
    per_lang: int = typer.Option(10, help="Calibration facts per non-English language."),
    en_items: int = typer.Option(30, help="English calibration facts (the <=1 pt guard)."),
    shots: int = SHOTS,
    max_tokens: int = o.MAX_TOKENS,
    form: str = FORM,
    dataset: Path | None = DATASET,
    variants: str = o.VARIANTS,
    recall_layers: str = RECALL_LAYERS,
    recall_scales: str = SCALES,
    translation_layers: str = TRANSLATION_LAYERS,
    translation_scales: str = SCALES,
    positions: str = o.POSITIONS,
    top_k: int = o.TOP_K,
    fine: str = o.FINE,
    max_en_drop: float = MAX_EN_DROP,
    max_en_logp_drop: float = MAX_EN_LOGP_DROP,
    dtype: str = DTYPE,
    device: str = DEVICE,
    batch_size: int = typer.Option(64, help="logp only: items per forward pass."),
    kv_cache_bytes: int = o.KV_CACHE,
    max_num_seqs: int = o.MAX_NUM_SEQS,
    cpu_threads: str = CPU_THREADS,
    holdout: int = HOLDOUT,
    overwrite: bool = typer.Option(False, help="Replace an existing artifact."),
    summary_dir: Path = typer.Option(
        Path("docs/results"), help="Where calibration.md / calibration.json go."
    ),
) -> None:
    """Sweep layer x scale x variant jointly on the calibration split; save the artifact.
    With --objective logp (the default) the winner is chosen on one half of the calibration facts
    and re-checked on the other; the artifact records whether it confirmed."""
    from steerserve.tune import calibrate_run as run

    grid = o.sweep_grid(
        variants, recall_layers, recall_scales, translation_layers, translation_scales,
        positions, top_k, fine, max_en_logp_drop, max_en_drop=max_en_drop, objective=objective,
    )  # fmt: skip
    cfg = run.CalibrateConfig(
        candidates, out, model, objective, per_lang, en_items, shots, max_tokens, form, dataset,
        grid, dtype, device, batch_size, kv_cache_bytes, max_num_seqs, cpu_threads, 0, holdout,
        overwrite, summary_dir,
    )  # fmt: skip
    o.call_run(run.run, cfg)
