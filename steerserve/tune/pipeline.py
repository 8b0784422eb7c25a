"""``steerserve tune`` as a function: check, size, then run the stages, skipping those a run of
the same settings finished, so a stop on an hour-long CPU run costs one stage, not the run.
"""

from __future__ import annotations

import datetime as _dt
import time
from pathlib import Path
from typing import Any

from steerserve.engine.defaults import RESEARCH_KV_CACHE_MEMORY_BYTES
from steerserve.tune import stages as S
from steerserve.tune.config import STAGES, TuneConfig, check, parts
from steerserve.tune.runs import ConfigError

STATE = "state.json"


def sized(cfg: TuneConfig, model_dir: Path) -> tuple[int, int, str]:
    """Scoring batch and engine KV bytes for this machine (given ones kept), and the line that
    says so: a GPU lets vLLM size its cache; a CPU gets 512 MiB and a batch by model size."""
    import json

    conf = json.loads((model_dir / "config.json").read_text())
    conf = conf.get("text_config", conf)
    params = 12 * conf.get("hidden_size", 0) ** 2 * conf.get("num_hidden_layers", 0)
    gpu = cfg.device.startswith("cuda")
    batch = cfg.batch_size or (32 if gpu else 16 if params > 5e8 else 64)
    kv = (
        cfg.kv_cache_bytes
        if cfg.kv_cache_bytes >= 0
        else (0 if gpu else RESEARCH_KV_CACHE_MEMORY_BYTES)
    )
    kv_txt = "vLLM's own" if kv == 0 else f"{kv >> 20} MiB"
    line = (
        f"sized for this machine: scoring batch {batch}, engine KV cache {kv_txt} "
        "(--batch-size / --kv-cache-memory-bytes change them; halve the batch if memory runs out)"
    )
    return batch, kv, line


def _state(work: Path, cfg: TuneConfig) -> dict[str, Any]:
    """The work folder's state; a folder of another run's settings is refused, naming them."""
    path = work / STATE
    if not path.exists():
        return {"settings": cfg.fingerprint(), "stages": {}}
    state = S.read_json(path)
    old, new = state["settings"], cfg.fingerprint()
    diff = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    if diff:
        raise ConfigError(
            f"{work} holds a run with other settings ({', '.join(diff)}); pass another --work "
            "or the same settings to resume it",
            "--work",
        )
    return state


def run(cfg: TuneConfig, log: Any = print) -> dict[str, Any]:
    """Run (or resume) the tune; the state with each stage's seconds. Everything that can be
    refused is refused before a model is loaded."""
    from steerserve.tune.extract import Candidates
    from steerserve.tune.runs import model_dir

    check(cfg)
    work = cfg.work_dir()
    state = _state(work, cfg)
    mdir = model_dir(cfg.model)
    fallback = "auto"
    if cfg.candidates is not None:
        fallback = Candidates.load(cfg.candidates).meta.get("form", "auto")
    p = parts(cfg, mdir, fallback)
    work.mkdir(parents=True, exist_ok=True)  # only once nothing was refused
    S.write_json(work / STATE, state)
    S.write_json(work / "splits.json", {"source": p.source, "form": p.form, **p.ids()})
    batch, kv, line = sized(cfg, mdir)
    log(line)
    ctx = S.Context(cfg, work, mdir, p, batch, kv, log)
    t_run = time.perf_counter()
    for i, name in enumerate(STAGES, 1):
        done = state["stages"].get(name)
        head = f"[{i}/{len(STAGES)}] {name}"
        if done:
            log(f"{head}: done in an earlier run ({done['seconds']} s), reused")
        else:
            log(f"{head} ... {_remaining(state, p, name)}")
            secs = S.timed(S.STAGE_FUNCTIONS[name], ctx)
            state["stages"][name] = {"seconds": secs, "finished": _now()}
            if name == "calibrate":
                c = S.read_json(work / "calibration.json")
                per = c["seconds"] / max(1, len(c["sweep"]) * c["n_items"])
                state["stages"][name]["per_item_setting_s"] = round(per, 4)
            S.write_json(work / STATE, state)
            log(f"{head}: {secs} s")
        if name == cfg.stop_after:
            log(f"stopped after {name} (--stop-after); run the same command again to go on")
            break
    state["seconds_this_run"] = round(time.perf_counter() - t_run, 1)
    if "publish" in state["stages"]:
        report = S.read_json(cfg.out / "report.json")
        log(f"wrote {cfg.out}: {report['verdict']}")
        # the artifact is where --out says (a path, from here): the commands that read it
        log(
            f"inspect: steerserve vectors show {cfg.out}; serve: steerserve serve {cfg.model} "
            f"--vectors-dir {cfg.out.parent.parent}"
        )
    return state


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def _remaining(state: dict[str, Any], p: Any, stage: str) -> str:
    """A rough estimate of what remains, from the scoring speed the calibration measured
    (seconds per item and setting; the engine's test is usually faster than that)."""
    cal = state["stages"].get("calibrate")
    if cal is None:
        if stage != "extract":
            return ""
        return f"{len(p.select)} selection, {len(p.confirm)} confirmation, {len(p.test)} test items"
    per_item = cal.get("per_item_setting_s")
    if per_item is None:
        return ""
    todo = {"confirm": 2 * len(p.confirm), "test": 3 * len(p.test)}
    left = sum(
        n
        for k, n in todo.items()
        if k not in state["stages"] and STAGES.index(k) >= STAGES.index(stage)
    )
    return f"(roughly {left * per_item / 60:.0f} min left)" if left else ""
