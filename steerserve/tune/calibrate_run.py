"""``steerserve lab calibrate`` as a function of one config: records, the sweep, the held-out
check, the artifact and the summary, so a script gets the same artifact as the command.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from steerserve.engine.defaults import RESEARCH_KV_CACHE_MEMORY_BYTES
from steerserve.tune import calibrate as cal
from steerserve.tune.arms import UNSTEERED
from steerserve.tune.extract import Candidates
from steerserve.tune.facts import default_shots
from steerserve.tune.runs import ConfigError


@dataclass
class CalibrateConfig:
    """Everything a calibration run reads (the CLI's options, already parsed)."""

    candidates: Path
    out: Path  # ROOT/NAME/VERSION
    model_dir: str | Path  # a folder or an embedded model's name; run resolves it
    objective: str = "logp"
    per_lang: int = 10
    en_items: int = 30
    shots: int | None = None
    max_tokens: int = 0  # 0: the form's budget
    form: str = "auto"
    dataset: Path | None = None
    grid: dict[str, Any] = field(default_factory=dict)  # cal.Grid.for_layers keywords
    dtype: str = "auto"  # engine dtype (accuracy) or transformers dtype (logp; see torch_dtype)
    device: str = "cpu"
    batch_size: int = 64
    kv_cache_bytes: int = RESEARCH_KV_CACHE_MEMORY_BYTES
    max_num_seqs: int = 64
    cpu_threads: str = ""
    threads: int = 0  # logp: torch threads (0: as many as cpu_threads lists, else torch's own)
    holdout: int = 0
    overwrite: bool = False
    summary_dir: Path = Path("docs/results")


def torch_dtype(dtype: str, device: str) -> str:
    """``--dtype`` for transformers: ``auto`` is float32 on CPU (bfloat16 matmuls are slow
    there) and bfloat16 on an accelerator."""
    if dtype == "auto":
        return "float32" if device == "cpu" else "bfloat16"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"{dtype!r}; known: auto, float32, bfloat16, float16", "--dtype")
    return dtype


def _resolved(cfg: CalibrateConfig) -> CalibrateConfig:
    """The log P objective's transformers dtype and torch thread count, checked before anything
    slow is loaded (the accuracy objective hands both to the engine as given)."""
    from dataclasses import replace

    from steerserve.engine.cpu import cores_of

    if cfg.objective not in cal.OBJECTIVES:
        raise ConfigError(f"{cfg.objective!r}; known: {', '.join(cal.OBJECTIVES)}", "--objective")
    if cfg.objective != "logp":
        return cfg
    dtype = torch_dtype(cfg.dtype, cfg.device)
    try:
        threads = cfg.threads or (len(cores_of(cfg.cpu_threads)) if cfg.cpu_threads else 0)
    except ValueError:
        raise ConfigError(f"{cfg.cpu_threads!r}: not a core list", "--cpu-threads") from None
    return replace(cfg, dtype=dtype, threads=threads)


def _checked(cfg: CalibrateConfig) -> CalibrateConfig:
    """``cfg`` with its settings checked and resolved, the model's folder last (an embedded
    model is converted on first use: slow, so only once the rest is known to be good)."""
    from dataclasses import replace

    from steerserve.tune.runs import model_dir

    cfg = _resolved(cfg)
    return replace(cfg, model_dir=model_dir(cfg.model_dir))


def _records(
    cfg: CalibrateConfig, cands: Candidates, check: bool
) -> tuple[list[dict], list[dict], str]:
    """The sweep's records, the held-out ones (no fact in both) and their form: the dataset's,
    else ``--form`` (auto: the form the candidates were extracted in)."""
    from steerserve.tune.records import load_records

    fallback = cands.meta.get("form", "completion")
    part = (0, 2) if check else (0, 1)
    try:
        records, form = load_records(
            cfg.dataset, cfg.model_dir, cfg.form, fallback, build=cal.calib_records,
            per_lang=cfg.per_lang, en_items=cfg.en_items, shots=cfg.shots, part=part,
        )  # fmt: skip
    except ValueError as e:
        raise ConfigError(str(e), "--dataset/--form") from None
    if cfg.dataset is not None:
        return *cal.split_records(records, check), form
    n_held = (cfg.holdout, cfg.holdout) if cfg.holdout else (cfg.per_lang, cfg.en_items)
    held = cal.calib_records(*n_held, cfg.shots, part=(1, 2), form=form) if check else []
    return records, held, form


def run(cfg: CalibrateConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Sweep, check on held-out facts, write the artifact and the summary; the result."""
    from steerserve.tune.replies import budget

    cfg = _checked(cfg)
    logp = cfg.objective == "logp"
    t0 = time.perf_counter()
    cands = Candidates.load(cfg.candidates)
    records, held, form = _records(cfg, cands, check=logp or bool(cfg.holdout))
    max_tokens = budget(form, cfg.max_tokens)
    try:
        grid = cal.Grid.for_layers(int(cands.meta["num_layers"]), **cfg.grid)
    except ValueError as e:
        raise ConfigError(str(e), "--positions") from None
    if logp and not any(r["lang"] != "en" for r in held):
        raise ConfigError(
            "the held-out half has no non-English record (give at least 2 per language)",
            "--dataset",
        )
    if logp:
        result, t_load = run_logp(cfg, cands, records, held, grid, log)
    else:
        result, t_load = _run_accuracy(cfg, cands, records, held, grid, max_tokens, log)
    source = str(cfg.dataset) if cfg.dataset else "calibration split"
    n_shots = default_shots(form, cfg.shots)
    if logp:
        result["prompts"] = (
            f"{source}, {form} form, {n_shots}-shot; teacher-forced log P(gold) and greedy "
            f"answers in transformers ({cfg.device}, {cfg.dtype})"
        )
        # Which items chose the pair and which checked it: no fact is in both.
        result["item_ids"] = [r.get("id") for r in records]
        result["holdout"]["item_ids"] = [r.get("id") for r in held]
    else:
        result["prompts"] = f"{source}, {form} form, {n_shots}-shot, greedy, <= {max_tokens} tokens"
    result["timings_s"] = {
        "extract": cands.meta.get("total_seconds"),
        "model_load" if logp else "engine_start": round(t_load, 1),
        "sweep": result["seconds"],
        "total_calibrate": round(time.perf_counter() - t0, 1),
    }
    name, version = cfg.out.parent.name, cfg.out.name
    art = cal.build_artifact(
        cands, result, cfg.model_dir, cfg.out, name, version, overwrite=cfg.overwrite
    )
    cal.write_summary(result, cfg.summary_dir)
    w = result["chosen"]
    log(f"wrote {art.path}: chosen {w['recall']} + {w['translation']}")
    for line in verdict(result, grid.max_en_logp_drop if logp else None):
        log(line)
    return result


def _run_accuracy(cfg, cands, records, held, grid, max_tokens, log):  # noqa: ANN001, ANN202
    """Select by greedy accuracy through the engine; re-check on ``held`` if any."""
    from steerserve.tune.evaluate import open_engine

    t0 = time.perf_counter()
    eng = open_engine(cfg.model_dir, cfg.dtype, cfg.max_num_seqs, cfg.kv_cache_bytes,
                      cpu_threads=cfg.cpu_threads or None)  # fmt: skip
    t_load = time.perf_counter() - t0
    try:
        result = cal.calibrate(eng, cands, records, grid, max_tokens, log=log)
        if held:
            cal.confirm(eng, cands, result, held, max_tokens, log=log)
    finally:
        eng.shutdown()
    return result, t_load


def run_logp(
    cfg: CalibrateConfig,
    cands: Candidates,
    records: list[dict],
    held: list[dict],
    grid: cal.Grid,
    log: Callable[[str], None] = print,
) -> tuple[dict[str, Any], float]:
    """Select by Δ log P(gold) on ``records``, confirm on ``held`` (transformers, a chat's gold
    forced after the model's own prefix); the result and the model's load seconds."""
    import torch

    from steerserve.tune.calibrate_logp import calibrate_logp, confirm_logp
    from steerserve.tune.hf import load_model
    from steerserve.tune.prefixes import answer_position_note, at_answer_position
    from steerserve.tune.runner import Runner

    n0 = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        t0 = time.perf_counter()
        mdl, tok = load_model(cfg.model_dir, device=cfg.device, dtype=cfg.dtype)
        t_load = time.perf_counter() - t0
        scorer = Runner(mdl, tok, cfg.batch_size)
        records, held = at_answer_position(scorer, records), at_answer_position(scorer, held)
        result = calibrate_logp(scorer, cands, records, grid, log=log)
        confirm_logp(scorer, cands, result, held, log=log)
        result["logp_position"] = answer_position_note(records + held)
    finally:
        torch.set_num_threads(n0)
    return result, t_load


def verdict(result: dict[str, Any], max_en_logp_drop: float | None) -> list[str]:
    """The selection and held-out verdict in words: a pair that did not confirm on facts it was not
    chosen on is noise until shown otherwise, so it is said where nobody can miss it."""
    w, base = result["chosen"], result[UNSTEERED]
    if max_en_logp_drop is None:
        out = [f"calib non-English {w['non_en']:.3f} ({UNSTEERED} {base['non_en']:.3f})"]
        if h := result.get("holdout"):
            out.append(
                f"held-out non-English gain {h['non_en_gain']:+.3f} (confirms: {h['confirms']})"
            )
        return out
    h = result["holdout"]
    lo, hi = w["d_logp_ci95"]
    out = [
        f"selection half ({result['n_items']} items): non-English Δ log P(gold) "
        f"{w['d_logp']:+.3f} [{lo:+.3f}, {hi:+.3f}] nats, English Δ log P {w['en_d_logp']:+.3f} "
        f"(guard -{max_en_logp_drop:g}); non-English accuracy {w['non_en']:.3f} "
        f"({UNSTEERED} {base['non_en']:.3f})"
    ]
    if not result["feasible"]:
        out.append("  (no pair kept English log P within its guard on the selection half)")
    lo, hi = h["d_logp_ci95"]
    alo, ahi = h["non_en_gain_ci95"]
    out.append(
        f"held-out half ({h['n_items']} items, other facts): non-English Δ log P(gold) "
        f"{h['d_logp']:+.3f} [{lo:+.3f}, {hi:+.3f}] nats, Δ accuracy {h['non_en_gain']:+.3f} "
        f"[{alo:+.3f}, {ahi:+.3f}], English Δ accuracy {h['en_change']:+.3f}, English Δ log P "
        f"{h['chosen']['en_d_logp']:+.3f} (95 % CIs, paired bootstrap)"
    )
    if h["confirms"]:
        out.append("confirmed on the held-out half (holdout.confirms=true in the artifact).")
    else:
        out.append(
            "DID NOT CONFIRM on the held-out half (it needs the Δ log P CI above 0, non-English "
            "accuracy not lower, English within its guards): the selection gain is not shown to "
            "be real. The artifact records holdout.confirms=false; do not ship it."
        )
    return out
