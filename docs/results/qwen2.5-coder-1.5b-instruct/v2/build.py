"""Build the v2 candidate artifact of Qwen2.5-Coder-1.5B-Instruct (issue 10): the translation
difference vector of step 3b (mean block output at the last prompt token of zero-shot chat
"Translate into <lang>: <answer_en>" prompts minus that of zero-shot chat questions, the 202 train
facts pooled over ja/ko/zh), at block 20, 0.5 x the raw difference, from the last prompt token on.
Chosen by the ceilings run (docs/results/ceilings/qwen2.5-coder-1.5b-instruct/README.md, step 3b).

    .venv/bin/python docs/results/qwen2.5-coder-1.5b-instruct/v2/build.py OUT_DIR

Reuses the ceilings run's kept means if present (partial/translation/means.pt), else recomputes
them (~7 min on 2 CPU cores)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from steerserve.artifacts import Intervention, Manifest, binding_for_model, save_artifact
from steerserve.models import load_hf_model, resolve_model
from steerserve.research.cache import cached_tensors
from steerserve.research.conditions import form_prompt, pooled_means, pooled_train_facts

MODEL = "qwen2.5-coder-1.5b-instruct"
LAYER, SCALE, LANGS = 20, 0.5, ["ja", "ko", "zh"]
KEPT = Path("docs/results/ceilings/qwen2.5-coder-1.5b-instruct/cjk24/partial/translation/means.pt")
RESULTS = "docs/results/ceilings/qwen2.5-coder-1.5b-instruct/README.md (step 3b)"


def main(out: Path) -> None:
    torch.set_num_threads(2)

    def means() -> dict[str, torch.Tensor]:
        model, tok = load_hf_model(MODEL)
        pool = pooled_train_facts(LANGS)
        groups = {k: [form_prompt(f, k, "chat") for f in pool] for k in ("convert0", "zero")}
        return pooled_means(model, tok, groups)

    m = cached_tensors(KEPT if KEPT.is_file() else None, means)
    d = (m["convert0"] - m["zero"])[LAYER]
    iv = Intervention(
        name="translation",
        tensor="translation",
        layer=LAYER,
        scale=SCALE,
        positions="last_prompt_and_generated",
        provenance={
            "construction": "issue 10 step 3b: mean(zero-shot chat 'Translate into <lang>: "
            "<answer_en>') - mean(zero-shot chat question), block output at the last prompt "
            "token, 202 train facts pooled over ja/ko/zh; raw units (scale x raw difference)",
            "built_by": "docs/results/qwen2.5-coder-1.5b-instruct/v2/build.py",
        },
        calibration={
            "objective": "paired change in mean teacher-forced log P(gold), non-English; "
            "selected on 48 calibration items (every 8th fact), confirmed on 156 others",
            "selection": {"d_logp": 1.169, "d_correct": 0.0},
            "holdout": {
                "n_items": 156,
                "d_logp": 0.866,
                "d_logp_ci95": [0.679, 1.060],
                "non_en_gain": 0.034,
                "non_en_gain_ci95": [0.009, 0.068],
                "en_change": 0.026,
                "confirms": True,
            },  # fmt: skip
            "results": RESULTS,
        },
    )
    manifest = Manifest(
        name=MODEL,
        version=out.name,
        description="translation difference vector at block 20 x 0.5 (issue 10 step 3b); "
        "see docs/results/qwen2.5-coder-1.5b-instruct/v2/README.md",
        model=binding_for_model(resolve_model(MODEL)),
        interventions=[iv],
    )
    art = save_artifact(out, manifest, {"translation": d}, overwrite=True)
    print(f"wrote {art.path}: translation @ {LAYER} x {SCALE}, |d| = {float(d.norm()):.2f}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
