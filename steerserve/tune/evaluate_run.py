"""``steerserve lab eval`` as a function of one config, so a script gets the same report; a
declared plan makes a test run once, and a budget that cut replies stops the run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from steerserve.engine.defaults import RESEARCH_KV_CACHE_MEMORY_BYTES
from steerserve.tune import evaluate as ev
from steerserve.tune import runs


@dataclass
class EvalConfig:
    """Everything an evaluation reads (the CLI's options, already parsed)."""

    model_dir: Path
    out: Path = Path("out/eval")
    artifact: Path | None = None  # None: the artifact 'auto' serves from vectors_dir
    vectors_dir: str | None = None
    dataset: Path | None = None  # None: the built-in split
    arms: tuple[str, ...] = ()  # (): every arm of the artifact, controls included
    limit_per_lang: int = 0  # 0: all
    part: tuple[int, int] = (0, 1)
    shots: int | None = None  # None: facts.default_shots
    split: str = "test"
    form: str = "auto"
    max_tokens: int = 0  # 0: the form's budget
    max_cut_share: float = 0.02
    plan: Path | None = None
    dtype: str = "auto"
    kv_cache_bytes: int = RESEARCH_KV_CACHE_MEMORY_BYTES
    max_num_seqs: int = 64
    cpu_threads: str = ""


def _records(cfg: EvalConfig, art: Any) -> tuple[list[dict], str]:
    """The records and their form (auto: the form the artifact was calibrated in)."""
    from steerserve.tune.records import load_records

    try:
        return load_records(
            cfg.dataset, cfg.model_dir, cfg.form, runs.artifact_form(art) or "auto",
            split=cfg.split, shots=cfg.shots, limit_per_lang=cfg.limit_per_lang or None,
            part=cfg.part,
        )  # fmt: skip
    except ValueError as e:
        raise runs.ConfigError(str(e), "--dataset/--form") from None


def run(cfg: EvalConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every arm on every record through vLLM, the report rewritten after each chunk; above
    ``max_cut_share`` cut replies it stops with :class:`BudgetError` after writing what it has."""
    from steerserve.tune.records import describe_source
    from steerserve.tune.replies import budget

    t0 = time.perf_counter()
    art = runs.choose_artifact(cfg.artifact, cfg.model_dir, cfg.vectors_dir, ("steered",))
    arm_list = runs.choose_arms(cfg.arms, art, controls=True)
    records, form = _records(cfg, art)
    max_tokens = budget(form, cfg.max_tokens)
    declared = runs.declared_plan(cfg.plan, cfg.out)
    eng = ev.open_engine(cfg.model_dir, cfg.dtype, cfg.max_num_seqs, cfg.kv_cache_bytes,
                         cpu_threads=cfg.cpu_threads or None)  # fmt: skip
    t_engine = time.perf_counter() - t0
    meta: dict = {
        "model": str(cfg.model_dir.name),
        "artifact": art.key,
        "dataset": describe_source(cfg.dataset, cfg.split, form, cfg.shots, cfg.part),
        "n_items": len(records),
        "max_tokens": max_tokens,
        "interventions": runs.interventions(art),
        **({"plan": declared} if declared else {}),
    }

    def write(done: int, results: dict, times: dict) -> dict:
        meta["timings_s"] = {"engine_start": round(t_engine, 1), **times}
        meta["timings_s"]["total"] = round(time.perf_counter() - t0, 1)
        meta["n_done"] = done
        meta["finished"] = done == len(records)
        report = ev.build_report(records[:done], results, meta)
        ev.write_report(report, cfg.out, results)
        ev.check_budget(results, max_tokens, cfg.max_cut_share)
        return report

    try:
        results, times = ev.evaluate(eng, art, records, arm_list, max_tokens, on_chunk=write)
    finally:
        eng.shutdown()
    report = write(len(records), results, times)
    for arm, a in report["arms"].items():
        log(f"{arm:12s} non-English mean {a['non_english_mean']:.3f}")
    log(f"wrote {cfg.out}/report.json, report.md, accuracy.png, replies.jsonl")
    return report
