"""The stages of ``steerserve tune`` (extract, calibrate, confirm, gate, test, publish), each
writing its outputs whole into the work folder, so a finished stage never runs again.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from steerserve.tune.config import Parts, TuneConfig
from steerserve.tune.reporting import read_json, write_json

Log = Callable[[str], None]


@dataclass
class Context:
    """What the stages share: the settings, folders, records and (loaded once, on first use)
    the transformers scorer."""

    cfg: TuneConfig
    work: Path
    model_dir: Path
    parts: Parts
    batch_size: int
    kv_cache_bytes: int
    log: Log = print
    _scorer: Any = field(default=None, repr=False)

    @property
    def artifact_dir(self) -> Path:
        return self.work / "artifact" / self.cfg.name / self.cfg.version

    def scorer(self) -> Any:
        """A ``runner.Runner`` on ``--device`` in the scoring dtype, loaded once."""
        if self._scorer is None:
            from steerserve.tune.calibrate_run import torch_dtype
            from steerserve.tune.hf import load_model
            from steerserve.tune.runner import Runner

            mdl, tok = load_model(
                self.model_dir, self.cfg.device, torch_dtype(self.cfg.dtype, self.cfg.device)
            )
            self._scorer = Runner(mdl, tok, self.batch_size)
        return self._scorer

    def release_scorer(self) -> None:
        self._scorer = None

    def candidates(self) -> Any:
        from steerserve.tune.extract import Candidates

        return Candidates.load(self.work / "candidates.safetensors")


def extract(ctx: Context) -> None:
    """Candidates from the model (or copied from ``--candidates``)."""
    out = ctx.work / "candidates.safetensors"
    cfg = ctx.cfg
    if cfg.candidates is not None:
        tmp = out.with_name(".candidates.tmp.safetensors")
        shutil.copyfile(cfg.candidates.with_suffix(".json"), tmp.with_suffix(".json"))
        shutil.copyfile(cfg.candidates, tmp)
        os.replace(tmp.with_suffix(".json"), out.with_suffix(".json"))
        os.replace(tmp, out)
        ctx.log(f"candidates given: {cfg.candidates}")
        return
    from steerserve.tune import extract as ex
    from steerserve.tune.calibrate_run import torch_dtype
    from steerserve.tune.facts import LANGS

    langs = tuple(x for x in LANGS if not cfg.languages or x == "en" or x in cfg.languages)
    ext = ex.ExtractConfig(
        per_lang=cfg.extract_per_lang, batch_size=ctx.batch_size, langs=langs,
        form=ctx.parts.form, recall_sources=cfg.recall_sources,
    )  # fmt: skip
    tmp = out.with_name(".candidates.tmp.safetensors")
    run = ex.ExtractRun(cfg.model, ctx.model_dir, tmp, cfg.device,
                        torch_dtype(cfg.dtype, cfg.device), cfg.threads, ext)  # fmt: skip
    ex.run(run, log=lambda _: None)
    os.replace(tmp.with_suffix(".json"), out.with_suffix(".json"))
    os.replace(tmp, out)


def calibrate(ctx: Context) -> None:
    """The joint sweep by Δ log P(gold) on the selection half (``calibrate_logp``)."""
    from steerserve.tune.calibrate import Grid
    from steerserve.tune.calibrate_logp import calibrate_logp
    from steerserve.tune.prefixes import at_answer_position

    cands = ctx.candidates()
    try:
        grid = Grid.for_layers(int(cands.meta["num_layers"]), objective="logp", **ctx.cfg.grid)
    except ValueError as e:
        from steerserve.tune.runs import ConfigError

        raise ConfigError(str(e), "--recall-layers/--translation-layers/--positions") from None
    records = at_answer_position(ctx.scorer(), ctx.parts.select)
    result = calibrate_logp(ctx.scorer(), cands, records, grid, log=ctx.log, progress=True)
    result["item_ids"] = [r["id"] for r in records]
    write_json(ctx.work / "calibration.json", _public(result))


def _public(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if not k.startswith("_")}


def calibration(ctx: Context) -> dict[str, Any]:
    """The calibration result with its winner rebuilt (``_winner``, as ``calibrate_logp`` made)."""
    from steerserve.tune.calibrate import Row, Setting

    result = read_json(ctx.work / "calibration.json")
    c = result["chosen"]
    result["_winner"] = Row(c["stage"], Setting.at(**c["recall"]), Setting.at(**c["translation"]))
    return result


def confirm(ctx: Context) -> None:
    """The chosen pair and the unsteered arm on the confirmation half, item by item."""
    from steerserve.tune.arms import UNSTEERED
    from steerserve.tune.calibrate_logp import confirm_logp
    from steerserve.tune.prefixes import at_answer_position

    result = calibration(ctx)
    held = at_answer_position(ctx.scorer(), ctx.parts.confirm)
    confirm_logp(ctx.scorer(), ctx.candidates(), result, held, log=ctx.log, progress=True)
    items = result["_holdout_items"]  # unsteered and chosen results, item by item
    keep = ("correct", "logp", "text")
    write_json(
        ctx.work / "confirm.json",
        {
            "holdout": result["holdout"],
            "records": [{"id": r["id"], "lang": r["lang"]} for r in held],
            "unsteered": [{k: x.get(k) for k in keep} for x in items[UNSTEERED]],
            "steered": [{k: x.get(k) for k in keep} for x in items["chosen"]],
        },
    )


def gate(ctx: Context) -> None:
    """The rule's decision on the confirmation half, and the artifact it gates."""
    from steerserve.tune import gate as rule
    from steerserve.tune.calibrate import build_artifact

    c = read_json(ctx.work / "confirm.json")
    decision = rule.decide(c["unsteered"], c["steered"], c["records"], ctx.cfg.gate)
    for lang, row in decision["languages"].items():
        ctx.log(f"  {lang}: {row['why']}")
    result = calibration(ctx)
    result["holdout"] = c["holdout"]
    if ctx.artifact_dir.exists():
        shutil.rmtree(ctx.artifact_dir)  # an interrupted gate's partial artifact
    build_artifact(
        ctx.candidates(), result, ctx.model_dir, ctx.artifact_dir, ctx.cfg.name,
        ctx.cfg.version, extra_provenance={"tune": _provenance(ctx, decision)},
        description=_description(decision), languages=rule.manifest_languages(decision),
    )  # fmt: skip
    write_json(ctx.work / "gates.json", decision)


def _provenance(ctx: Context, decision: dict[str, Any]) -> dict[str, Any]:
    """How the artifact was made, in its manifest: the rule, its settings and the splits."""
    return {
        "gate_rule": decision["rule"],
        "gate_settings": decision["settings"],
        "items_needed": decision["items_needed"],
        "english_guard": decision["english"],
        "records": ctx.parts.source,
        "form": ctx.parts.form,
        "n": {k: len(v) for k, v in ctx.parts.ids().items()},
    }


def _description(decision: dict[str, Any]) -> str:
    opened = [k for k, v in decision["languages"].items() if v["open"]]
    k = len(decision["languages"])
    which = ", ".join(opened) if opened else "no language"
    return f"steerserve tune: auto steers {which} ({len(opened)} of {k} confirmed)"


def test(ctx: Context) -> None:
    """The test split once: unsteered, auto (the gate) and both (steering on), as served."""
    import gc

    from steerserve.tune.testing import run_test

    ctx.release_scorer()  # the engine needs the memory the transformers copy holds
    gc.collect()
    run_test(ctx)


def publish(ctx: Context) -> None:
    """The gated artifact at ``--out`` (verified against the model) and its report beside it."""
    from steerserve.artifacts import load_artifact
    from steerserve.tune.summary import write_report

    out = ctx.cfg.out
    if (out / "manifest.json").exists():
        raise FileExistsError(f"{out} exists already: a published version never changes")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.publishing")
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(ctx.artifact_dir, tmp)
    write_report(ctx, tmp)
    load_artifact(tmp, model_dir=ctx.model_dir)
    os.replace(tmp, out)


STAGE_FUNCTIONS: dict[str, Callable[[Context], None]] = {
    "extract": extract,
    "calibrate": calibrate,
    "confirm": confirm,
    "gate": gate,
    "test": test,
    "publish": publish,
}


def timed(fn: Callable[[Context], None], ctx: Context) -> float:
    t0 = time.perf_counter()
    fn(ctx)
    return round(time.perf_counter() - t0, 1)
