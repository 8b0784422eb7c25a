"""``steerserve train-vector``: facts, the model's own prefixes, training, the artifact.

Selection and confirmation never share facts or relations: training (and early stopping) use
the calibration split's first half and ``relations``; the confirmation set written beside the
artifact is the second half, every relation, marked by whether its relation was trained on.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from steerserve.research.facts import RELATIONS, eval_records
from steerserve.research.prefixes import answer_position_note, with_prefixes
from steerserve.research.replies import read_replies
from steerserve.research.train_vector import (
    TrainConfig,
    check_training_set,
    items_of,
    provenance,
    train,
    write_curve,
)


@dataclass
class RunConfig:
    """One training run: model, facts, where its prefixes come from, and the artifact."""

    model_dir: Path
    out: Path
    train: TrainConfig
    relations: tuple[str, ...] = ("capital_of", "city_in")
    langs: tuple[str, ...] | None = None
    replies: Path | None = None  # the model's unsteered replies to the selection half
    replies_arm: str = "zero"
    report_dir: Path = Path("out/train-vector")  # curve.json, confirmation.jsonl
    dtype: str = "bfloat16"
    threads: int = 0


def selection_records(cfg: RunConfig) -> list[dict]:
    """The calibration split's first half, chat form, the trained relations."""
    return eval_records("calib", langs=cfg.langs, relations=cfg.relations, part=(0, 2), form="chat")


def confirmation_records(cfg: RunConfig) -> list[dict]:
    """The second half, every relation; ``held_out_relation`` marks the untrained ones."""
    recs = eval_records("calib", langs=cfg.langs, part=(1, 2), form="chat")
    return [{**r, "held_out_relation": r["id"].split(":")[0] not in cfg.relations} for r in recs]


def own_prefixes(cfg: RunConfig, records: Sequence[dict], runner: Callable[[], Any]) -> list[dict]:
    """Records with the model's own prefixes: from kept replies (``cfg.replies``, the arm's
    replies to these items), else one unsteered greedy pass of the research runner."""
    if cfg.replies is not None:
        texts = {r.id: r.text for r in read_replies(cfg.replies) if r.arm == cfg.replies_arm}
        missing = [r["id"] for r in records if r["id"] not in texts]
        if missing:
            raise ValueError(f"{cfg.replies} has no {cfg.replies_arm!r} reply for {missing[:3]}…")
        return with_prefixes(records, [texts[r["id"]] for r in records])
    from steerserve.research.prefixes import at_answer_position

    return at_answer_position(runner(), records)


def split(records: Sequence[dict], every: int = 4) -> tuple[list[dict], list[dict], list[dict]]:
    """Non-English training items, every ``every``-th held aside for early stopping, and the
    English items (KL only)."""
    ne = [r for r in records if r["lang"] != "en"]
    return (
        [r for i, r in enumerate(ne) if i % every],
        ne[::every],
        [r for r in records if r["lang"] == "en"],
    )


def run(cfg: RunConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train, save the artifact (``cfg.out``), its curve and the confirmation set
    (``cfg.report_dir``)."""
    import torch

    from steerserve.artifacts import Intervention, Manifest, binding_for_model, save_artifact
    from steerserve.models import load_hf_model

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[cfg.dtype]
    model, tok = load_hf_model(cfg.model_dir, dtype=dtype)

    def runner() -> Any:
        from steerserve.research.runner import Runner

        return Runner(model, tok)

    recs = own_prefixes(cfg, selection_records(cfg), runner)
    check_training_set(recs)
    tr, val, en = split(recs)
    log(f"{len(tr)} training, {len(val)} early-stopping, {len(en)} English (KL) items")
    v, curve, unit = train(model, tok, items_of(tok, tr), items_of(tok, val), items_of(tok, en),
                           cfg.train, log=log)  # fmt: skip
    notes = {
        "prefixes": answer_position_note(recs),
        "relations_trained": list(cfg.relations),
        "relations_held_out": [r for r in RELATIONS if r not in cfg.relations],
        "seconds": round(time.perf_counter() - t0, 1),
    }
    iv = Intervention(
        name="learned",
        tensor="learned",
        layer=cfg.train.layer,
        scale=1.0,
        positions="last_prompt_and_generated",
        provenance=provenance(
            cfg.train, [r["id"] for r in tr], [r["id"] for r in val], curve, unit, notes
        ),  # fmt: skip
    )
    manifest = Manifest(
        name=cfg.model_dir.name,
        version=cfg.out.name,
        description=f"learned vector at block {cfg.train.layer} (steerserve train-vector); "
        "not confirmed until its confirmation set says so",
        model=binding_for_model(cfg.model_dir),
        interventions=[iv],
    )
    save_artifact(cfg.out, manifest, {"learned": v.float()}, overwrite=True)
    cfg.report_dir.mkdir(parents=True, exist_ok=True)
    write_curve(cfg.report_dir / "curve.json", curve)
    conf = confirmation_records(cfg)
    path = cfg.report_dir / "confirmation.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in conf), "utf-8")
    log(f"wrote {cfg.out}: |v| = {float(v.norm()):.3f} ({float(v.norm()) / unit:.3f} x the "
        f"block's mean residual norm), best step {curve.best_step}; confirm with steerserve eval "
        f"--artifact {cfg.out} --dataset {path} --arms unsteered,learned")  # fmt: skip
    return {"norm": float(v.norm()), "unit": unit, "best_step": curve.best_step, **notes}
