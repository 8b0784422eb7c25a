"""Build the v2 candidate artifact of Qwen2.5-Coder-1.5B-Instruct (issue 10): the translation
difference vector of step 3b at block 20, 0.5 x the raw difference, from the last prompt token on,
with the calibration record of its selection and held-out check. Chosen by the ceilings run
(docs/results/ceilings/qwen2.5-coder-1.5b-instruct/README.md, step 3b).

    .venv/bin/python docs/results/qwen2.5-coder-1.5b-instruct/v2/build.py OUT_DIR

is the command `steerserve translation-vector` (research/translation_artifact.py) with v2's
settings; see README.md here for the same call on the command line. Reuses the ceilings run's kept
means if present (partial/translation/means.pt), else recomputes them (~7 min on 2 CPU cores)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from steerserve.models import resolve_model
from steerserve.research.translation_artifact import TranslationArtifactConfig, run

HERE = Path(__file__).parent
MODEL = "qwen2.5-coder-1.5b-instruct"
KEPT = Path("docs/results/ceilings/qwen2.5-coder-1.5b-instruct/cjk24/partial/translation/means.pt")


def main(out: Path) -> None:
    run(
        TranslationArtifactConfig(
            model_dir=resolve_model(MODEL),
            out=out,
            layer=20,
            scale=0.5,
            langs=("ja", "ko", "zh"),
            form="chat",
            means=KEPT,
            name=MODEL,
            description="translation difference vector at block 20 x 0.5 (issue 10 step 3b); "
            "see docs/results/qwen2.5-coder-1.5b-instruct/v2/README.md",
            calibration=json.loads((HERE / "calibration.json").read_text(encoding="utf-8")),
            provenance={"chosen_by": "issue 10 step 3b"},
            threads=2,
            overwrite=True,
        )
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
