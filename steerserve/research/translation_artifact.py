"""``steerserve translation-vector``: an artifact of one intervention, the translation difference
vector at one block (issue 10 step 3b; Qwen2.5-Coder-1.5B-Instruct's v2 candidate).

The vector is mean block output at the last prompt token of zero-shot "Translate into <lang>:
<answer_en>" prompts minus that of zero-shot questions, over every train fact once, pooled over
``langs`` (``conditions.pooled_train_facts``), in raw units: the artifact's scale multiplies the
raw difference. Added from the last prompt token on (``last_prompt_and_generated``: the engine's
``add``, no new operation).

Why a command and not a script under docs/results/: the construction is the ceilings run's
``translation`` condition, so it is built by the same functions, tested on the tiny model, and a
result's README names a command anyone can rerun.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from steerserve.artifacts import Artifact


@dataclass
class TranslationArtifactConfig:
    """What to build: the model, the artifact folder ROOT/NAME/VERSION, the block and scale."""

    model_dir: Path
    out: Path  # the artifact's folder; its name is the artifact's version
    layer: int
    scale: float = 0.5  # x the raw difference
    langs: tuple[str, ...] = ("ja", "ko", "zh")
    form: str = "auto"  # chat or completion prompts (auto: by the model's name)
    means: Path | None = None  # kept group means: reused when present, else computed and kept
    name: str | None = None  # the artifact's name (default: the model folder's name)
    description: str = ""
    calibration: dict[str, Any] | None = None  # how the setting was chosen and checked
    provenance: dict[str, Any] = field(default_factory=dict)  # added to the construction's
    batch_size: int = 16
    threads: int = 0  # torch threads; 0: torch's own
    overwrite: bool = False


def group_means(cfg: TranslationArtifactConfig, form: str) -> dict[str, torch.Tensor]:
    """Mean last-token block outputs ``[L, H]`` of the zero-shot conversion (``convert0``) and
    question (``zero``) prompts of the pooled train facts; kept in ``cfg.means`` if given."""
    from steerserve.models import load_hf_model
    from steerserve.research.cache import cached_tensors
    from steerserve.research.conditions import form_prompt, pooled_means, pooled_train_facts

    def compute() -> dict[str, torch.Tensor]:
        model, tok = load_hf_model(cfg.model_dir)
        pool = pooled_train_facts(list(cfg.langs))
        groups = {k: [form_prompt(f, k, form) for f in pool] for k in ("convert0", "zero")}
        return pooled_means(model, tok, groups, cfg.batch_size)

    return cached_tensors(cfg.means, compute)


def run(cfg: TranslationArtifactConfig, log: Callable[[str], None] = print) -> Artifact:
    """Build and save the artifact; it. A layer outside the model is a ``runs.ConfigError``."""
    from steerserve.artifacts import (
        ArtifactError,
        Intervention,
        Manifest,
        binding_for_model,
        save_artifact,
    )
    from steerserve.research.conditions import pooled_train_facts
    from steerserve.research.records import default_form
    from steerserve.research.runs import ConfigError, RunError

    try:
        form = default_form(cfg.model_dir, cfg.form)
    except ValueError as e:
        raise ConfigError(str(e), "--form") from None
    binding = binding_for_model(cfg.model_dir)
    if not 0 <= cfg.layer < binding.num_layers:
        raise ConfigError(
            f"{cfg.layer} is not a block of the model (0..{binding.num_layers - 1})", "--layer"
        )
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    m = group_means(cfg, form)
    d = (m["convert0"] - m["zero"])[cfg.layer]
    n_facts, langs = len(pooled_train_facts(list(cfg.langs))), "/".join(cfg.langs)
    iv = Intervention(
        name="translation",
        tensor="translation",
        layer=cfg.layer,
        scale=cfg.scale,
        positions="last_prompt_and_generated",
        provenance={
            "construction": f"mean(zero-shot {form} 'Translate into <lang>: <answer_en>') - "
            f"mean(zero-shot {form} question), block output at the last prompt token, {n_facts} "
            f"train facts pooled over {langs}; raw units (scale x raw difference)",
            "built_by": "steerserve translation-vector",
            **cfg.provenance,
        },
        calibration=cfg.calibration,
    )
    manifest = Manifest(
        name=cfg.name or cfg.model_dir.name,
        version=cfg.out.name,
        description=cfg.description
        or f"translation difference vector at block {cfg.layer} x {cfg.scale:g}",
        model=binding,
        interventions=[iv],
    )
    try:
        art = save_artifact(cfg.out, manifest, {"translation": d}, overwrite=cfg.overwrite)
    except ArtifactError as e:  # one there already, without --overwrite
        raise RunError(str(e)) from None
    log(f"wrote {art.path}: translation @ {cfg.layer} x {cfg.scale:g}, |d| = {float(d.norm()):.2f}")
    return art


def read_calibration(path: Path | None) -> dict[str, Any] | None:
    """The calibration record to copy into the manifest (a JSON object), or None."""
    if path is None:
        return None
    raw = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a calibration record must be a JSON object")
    return raw
