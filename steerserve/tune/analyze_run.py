"""``steerserve lab analyze`` as a function of one config, so a notebook gets the same report
as the command.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from steerserve.tune import analyze as an
from steerserve.tune import runs


@dataclass
class AnalyzeConfig:
    """Everything a diagnosis reads (the CLI's options, already parsed)."""

    model_dir: Path
    out: Path = Path("out/analysis")
    dataset: Path | None = None  # None: the built-in split
    split: str = "test"
    shots: int | None = None  # None: facts.default_shots
    form: str = "auto"
    sample: int = 12  # per language, seeded; 0: all
    seed: int = 0
    langs: tuple[str, ...] | None = None  # None: all
    artifact: Path | None = None  # None: the artifact 'auto' serves from vectors_dir
    vectors_dir: str | None = None
    arms: tuple[str, ...] = ()  # (): unsteered, each intervention, both
    threshold: int = 10
    window: tuple[int, int] | None = None  # None: the second half of the blocks
    max_tokens: int = 0  # 0: the form's budget
    batch_size: int = 8
    threads: int = 0  # torch threads; 0: torch's own
    device: str = "cpu"
    dtype: str = "float32"


def _records(cfg: AnalyzeConfig, art: Any) -> tuple[list[dict], str]:
    """The seeded sample of records and their form (auto: the artifact's, else the model's)."""
    from steerserve.tune.records import load_records

    try:
        records, form = load_records(
            cfg.dataset, cfg.model_dir, cfg.form, runs.artifact_form(art) or "auto",
            split=cfg.split, shots=cfg.shots, langs=cfg.langs,
        )  # fmt: skip
    except ValueError as e:
        raise runs.ConfigError(str(e), "--dataset/--form") from None
    return an.sample(records, cfg.sample, cfg.langs, cfg.seed), form


def run(cfg: AnalyzeConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Logit lens and recall-vs-conversion failures for every arm; report.json/md and figures
    are rewritten after each arm. The final report."""
    import torch

    from steerserve.tune import analyze_report as ar
    from steerserve.tune.hf import decoder_layers, load_model
    from steerserve.tune.records import describe_source
    from steerserve.tune.replies import budget

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()
    art = runs.choose_artifact(cfg.artifact, cfg.model_dir, cfg.vectors_dir, cfg.arms)
    arm_list = runs.choose_arms(cfg.arms, art, controls=False)
    records, form = _records(cfg, art)
    lens = an.LensConfig(cfg.threshold, cfg.window, budget(form, cfg.max_tokens), cfg.batch_size)
    mdl, tok = load_model(cfg.model_dir, device=cfg.device, dtype=cfg.dtype)
    n_layers = len(decoder_layers(mdl))
    lens.blocks(n_layers)  # fail now on a bad window, not after the first arm
    meta: dict = {
        "model": cfg.model_dir.name,
        "dataset": describe_source(cfg.dataset, cfg.split, form, cfg.shots),
        "n_items": len(records),
        "sample_per_lang": cfg.sample or "all",
        "sample_seed": cfg.seed,
        "vocab_size": int(mdl.config.get_text_config().vocab_size),
    }
    if art is not None:
        meta["artifact"] = art.key
        meta["interventions"] = runs.interventions(art)

    def write(results: dict, times: dict) -> dict:
        meta["timings_s"] = {**times, "total": round(time.perf_counter() - t0, 1)}
        rep = ar.build_report(results, lens, n_layers, meta)
        ar.write_report(rep, cfg.out)
        return rep

    results, times = an.run(mdl, tok, records, lens, arm_list, art, on_arm=write)
    rep = write(results, times)
    for arm, r in rep["arms"].items():
        ne, f = r["non_english"], r["non_english"]["failures"]
        log(
            f"{arm:12s} non-English acc {ne['accuracy']:.3f}  wrong {f['wrong']}: "
            f"recall {f['recall']} / conversion {f['conversion']}"
        )
    log(f"wrote {cfg.out}/report.json, report.md, lens_*.png, failures.png")
    return rep
