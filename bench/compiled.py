"""Compiled graphs (issue 48): stock vLLM vs steerserve, both ``torch.compile``d, one checkpoint.

A different question from ``bench_serve.py``'s (the benchmark of record, through ``steerserve
serve`` over HTTP): what the steering ops alone cost inside compiled graphs, engine against engine
through the Python API, with no server, admission, artifact or degeneracy check around them (that
difference hid issue 60's cost: the server's check, not the ops, cost a fifth).

Compiled, every hooked layer's ops stay in the graph: with CUDA graphs they run on every step, on
a CPU their gates skip the arithmetic of idle layers (kernels.py); this measures what that costs. Per round, one engine at a time and their order alternating: the stock
engine (no ``Steered<Arch>``) and the plugin's engine, each warmed, then burst tokens/s of
``--concurrency`` greedy requests submitted at once (``ignore_eos``, ``--tokens`` each; the median
of ``--repeats`` ABBA passes per engine). The
plugin's engine runs three arms, rotated every round: ``idle`` (nothing steered), ``add`` (every
request steered with overhead.py's two ``add`` entries) and ``ablate`` (the same entries with
``op: ablate``). Ratios are per round (paired: same round, same load), summarised by their median
and a seeded 95 % bootstrap interval over rounds (latency.py's); with 3 rounds the interval is
coarse, so read it against the target's margin, on a quiet machine only.

    python bench/compiled.py --model PATH --rounds 3 --tokens 128 --out out/compiled.json
    python bench/compiled.py --dry-run --model PATH     # 1 round, 4 tokens: does it run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent))
from latency import _ratios, cpu_info, model_dir, ratio, ratio_ci  # noqa: E402
from overhead import _entries, _prompts, _tps, build_engine, register_vectors  # noqa: E402

if TYPE_CHECKING:
    from steerserve.engine.api import SteerEngine

ARMS = ("idle", "add", "ablate")
#: ratio name -> (numerator arm, denominator arm)
RATIOS = {
    "idle/stock": ("idle", "stock"),
    "add/idle": ("add", "idle"),
    "ablate/idle": ("ablate", "idle"),
}


def steering_of(arm: str, eng: SteerEngine, n: int) -> list[list[dict]] | None:
    """Every request's entries in ``arm``: none, overhead.py's, or those as ablations."""
    if arm in ("stock", "idle"):
        return None
    entries = _entries(eng) if arm == "add" else [e | {"op": "ablate"} for e in _entries(eng)]
    return [entries] * n


def measure(
    eng: SteerEngine, arms: list[str], a: argparse.Namespace
) -> dict[str, dict[str, float]]:
    """Burst tokens/s of each arm at each concurrency on one engine: one warm-up each (first-use
    costs: compile of a new size, the steered path's first rows), then ``--repeats`` passes over
    the arms, every other one reversed (ABBA: a drift inside the engine's life hits every arm
    alike); an arm's value is the median of its passes."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True)
    out: dict[str, dict[str, float]] = {arm: {} for arm in arms}
    for c in a.concurrency:
        prompts = _prompts(c)
        for arm in arms:
            _tps(eng, prompts, steering_of(arm, eng, c), sp)
        runs: dict[str, list[float]] = {arm: [] for arm in arms}
        for i in range(a.repeats):
            for arm in arms if i % 2 == 0 else arms[::-1]:
                runs[arm].append(_tps(eng, prompts, steering_of(arm, eng, c), sp))
        print(json.dumps({"concurrency": c, "tokens_per_s": runs}), flush=True)
        for arm in arms:
            out[arm][f"c{c}"] = statistics.median(runs[arm])
    return out


def one_engine(kind: str, model: str, r: int, a: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Start ``stock`` or the plugin's engine, measure its arms (rotated by round), stop it."""
    steering = kind == "steerserve"
    eng = build_engine(
        model, max(a.concurrency), a.kv_cache_bytes, compiled=True, steering=steering, dtype=a.dtype
    )
    try:
        if not steering:
            return measure(eng, ["stock"], a)
        register_vectors(eng)
        return measure(eng, [ARMS[(i + r) % len(ARMS)] for i in range(len(ARMS))], a)
    finally:
        eng.shutdown()


def summarise(tps: dict[str, dict[str, list[float]]], a: argparse.Namespace) -> dict:
    """Per-round ratios, their median and bootstrap interval, for every ratio and concurrency."""
    out: dict[str, dict[str, dict]] = {}
    for name, (num, den) in RATIOS.items():
        out[name] = {}
        for c in a.concurrency:
            key = f"c{c}"
            lo, hi = ratio_ci(tps, num, den, key)
            out[name][key] = {
                "median": ratio(tps, num, den, key),
                "ci95": [lo, hi],
                "per_round": _ratios(tps, num, den, key),
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="checkpoint folder, model name, or tiny")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per request")
    ap.add_argument("--repeats", type=int, default=2, help="timed passes over the arms per engine")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--kv-cache-bytes", type=int, default=1 << 30, help="0: vLLM sizes it (GPU)")
    ap.add_argument("--out", type=Path, default=Path("out/compiled.json"))
    ap.add_argument("--dry-run", action="store_true", help="1 round of 4 tokens: does it run")
    a = ap.parse_args()
    if a.dry_run:
        a.rounds, a.tokens, a.repeats = 1, 4, 1
    # vLLM's default multi-process mode, as served (tests set single-process for their engines)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    import torch

    from steerserve.engine.cpu import bind_all_cores

    # as `steerserve serve` runs a CPU worker: its threads on every core (vLLM's `auto` keeps one
    # for the front end); both engines alike, GPUs untouched
    bind_all_cores(os.environ, torch.cuda.is_available(), 1)

    model = str(model_dir(a.model))
    tps: dict[str, dict[str, list[float]]] = {
        arm: {f"c{c}": [] for c in a.concurrency} for arm in ("stock", *ARMS)
    }
    t0 = time.perf_counter()
    for r in range(a.rounds):  # the engines alternate, so drift hits both alike
        for kind in ("stock", "steerserve") if r % 2 == 0 else ("steerserve", "stock"):
            for arm, by_c in one_engine(kind, model, r, a).items():
                for key, v in by_c.items():
                    tps[arm][key].append(v)
            print(json.dumps({"round": r, "engine": kind, "elapsed_s": time.perf_counter() - t0}))
    summary = {
        "model": Path(model).name,
        "dtype": a.dtype,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else cpu_info(),
        "rounds": a.rounds,
        "tokens": a.tokens,
        "repeats": a.repeats,
        "threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        "concurrency": a.concurrency,
        "dry_run": a.dry_run,
        "tokens_per_s": tps,
        "ratios": summarise(tps, a),
        "wall_s": time.perf_counter() - t0,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(summary, indent=2))
    print(
        "\n| ratio | "
        + " | ".join(f"{c} concurrent (median, 95 % CI)" for c in a.concurrency)
        + " |"
    )
    print("|---|" + "---|" * len(a.concurrency))
    for name, by_c in summary["ratios"].items():
        cells = [
            f"{v['median']:.3f} [{v['ci95'][0]:.3f}, {v['ci95'][1]:.3f}]" for v in by_c.values()
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(f"\nwritten: {a.out}")


if __name__ == "__main__":
    main()
