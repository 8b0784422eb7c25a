"""What the plugin costs an engine (issues 7, 48): stock vLLM vs steerserve's engine through the
Python API, one checkpoint, compiled (``--no-compile``: eager), ratios with intervals in one run.

A different question from ``bench_serve.py``'s (the benchmark of record, through ``steerserve
serve`` over HTTP): the steering ops alone, with no server, admission, artifact or degeneracy
check around them (that difference hid issue 60's cost: the server's check, not the ops, cost a
fifth). Compiled, every hooked layer's ops stay in the graph: with CUDA graphs they run on every
step, on a CPU their gates skip the arithmetic of idle layers (kernels.py).

Per round, one engine at a time and their order alternating: the stock engine (no
``Steered<Arch>``) and the plugin's, each warmed, then burst tokens/s of ``--concurrency`` greedy
requests submitted at once (``ignore_eos``, ``--tokens`` each; the median of ``--repeats`` ABBA
passes per engine). The plugin's engine runs ``--arms``, rotated every round: ``idle`` (nothing
steered), ``add`` (every request steered with two entries) and ``ablate`` (the same entries with
``op: ablate``); it also times the front end's admission per request (validation, encoding,
salt). Ratios are per round (paired), summarised by their median and a seeded 95 % bootstrap
interval over rounds; with 3 rounds the interval is coarse: read it on a quiet machine only.

    python bench/overhead.py --model PATH --rounds 3 --tokens 128 --out out/overhead.json
    python bench/overhead.py --no-compile --model default --concurrency 32 --tokens 64
    python bench/overhead.py --dry-run --model PATH     # 1 round, 4 tokens: does it run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import harness

if TYPE_CHECKING:
    from steerserve.engine.api import SteerEngine

ARMS = ("idle", "add", "ablate")
#: ratio name -> (numerator arm, denominator arm)
RATIOS = {"idle/stock": ("idle", "stock"), "add/idle": ("add", "idle"),
          "ablate/idle": ("ablate", "idle")}  # fmt: skip


def entries(eng: SteerEngine, op: str = "add") -> list[dict]:
    """Two entries at a third and two thirds of the depth, the seeded vectors of ``build``."""
    n = eng.shape.num_layers
    first = {"vector": "bench/a", "layer": n // 3, "scale": 2.0, "op": op}
    second = {"vector": "bench/b", "layer": (2 * n) // 3, "scale": 1.0, "op": op}
    return [first | {"positions": "last_prompt_and_generated"}, second | {"positions": "all"}]


def build(model: str, a: argparse.Namespace, steering: bool) -> SteerEngine:
    """The engine of every arm: stock (``steering=False``) or the plugin's, same settings; no
    prefix caching, so every pass does the same work; the plugin's holds two random vectors."""
    import torch

    from steerserve.engine.api import EngineConfig, SteerEngine

    eng = SteerEngine(
        EngineConfig(
            model=model, dtype=a.dtype, max_model_len=512, max_num_seqs=max(a.concurrency),
            kv_cache_memory_bytes=a.kv_cache_bytes or None, enforce_eager=not a.compile,
            enable_prefix_caching=False, steering=steering,
        )
    )  # fmt: skip
    if steering:
        g = torch.Generator().manual_seed(0)
        for name in ("bench/a", "bench/b"):
            eng.register_vector(name, torch.randn(eng.shape.hidden_size, generator=g))
    return eng


def tps(eng: SteerEngine, prompts: list[str], steering: Any, sp: Any) -> float:
    t = time.perf_counter()
    outs = eng.generate(prompts, sp, steering=steering)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)


def admission_us(eng: SteerEngine, n: int = 20000) -> float:
    """Front-end microseconds per request: entries prepared, prompt made, steering attached."""
    from vllm import SamplingParams

    from steerserve.engine.api import make_prompt, with_steering

    steer, sp = entries(eng), SamplingParams(max_tokens=8)
    t = time.perf_counter()
    for i in range(n):
        with_steering(sp, eng.admission.prepare(steer))
        make_prompt(f"prompt {i}")
    return (time.perf_counter() - t) / n * 1e6


def measure(eng: SteerEngine, arms: list[str], a: argparse.Namespace) -> dict[str, dict]:
    """Burst tokens/s of each arm at each concurrency on one engine: one warm-up each (first-use
    costs), then ``--repeats`` passes over the arms, every other one reversed (ABBA: a drift in
    the engine's life hits every arm alike); an arm's value is the median of its passes."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True)
    out: dict[str, dict[str, float]] = {arm: {} for arm in arms}
    for c in a.concurrency:
        prompts = harness.prompts(c)
        steer = {arm: None if arm in ("stock", "idle") else [entries(eng, arm)] * c for arm in arms}
        for arm in arms:
            tps(eng, prompts, steer[arm], sp)
        runs: dict[str, list[float]] = {arm: [] for arm in arms}
        for i in range(a.repeats):
            for arm in arms if i % 2 == 0 else arms[::-1]:
                runs[arm].append(tps(eng, prompts, steer[arm], sp))
        print(json.dumps({"concurrency": c, "tokens_per_s": runs}), flush=True)
        for arm in arms:
            out[arm][f"c{c}"] = statistics.median(runs[arm])
    return out


def one_engine(kind: str, model: str, r: int, a: argparse.Namespace) -> tuple[dict, float | None]:
    """Start ``stock`` or the plugin's engine, measure its arms (rotated by round), stop it."""
    eng = build(model, a, steering=kind == "steerserve")
    try:
        if kind == "stock":
            return measure(eng, ["stock"], a), None
        arms = [a.arms[(i + r) % len(a.arms)] for i in range(len(a.arms))]
        return measure(eng, arms, a), admission_us(eng)
    finally:
        eng.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="checkpoint folder, model name, or tiny")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                    help="torch.compile both engines (--no-compile: eager)")  # fmt: skip
    ap.add_argument("--arms", default=",".join(ARMS), help=f"the plugin's, of {','.join(ARMS)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per request")
    ap.add_argument("--repeats", type=int, default=2, help="timed passes over the arms per engine")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--kv-cache-bytes", type=int, default=1 << 30, help="0: vLLM sizes it (GPU)")
    ap.add_argument("--out", type=Path, default=Path("out/overhead.json"))
    ap.add_argument("--dry-run", action="store_true", help="1 round of 4 tokens: does it run")
    a = ap.parse_args()
    a.arms = [x for x in a.arms.split(",") if x]
    if not a.arms or set(a.arms) - set(ARMS):
        ap.error(f"--arms: some of {', '.join(ARMS)}")
    if a.dry_run:
        a.rounds, a.tokens, a.repeats = 1, 4, 1
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # vLLM's default, as served
    import torch

    from steerserve.engine.cpu import bind_all_cores

    # as `steerserve serve` runs a CPU worker: its threads on every core; GPUs untouched
    bind_all_cores(os.environ, torch.cuda.is_available(), 1)
    model = str(harness.model_dir(a.model))
    tps_: dict[str, dict[str, list[float]]] = {
        arm: {f"c{c}": [] for c in a.concurrency} for arm in ("stock", *a.arms)
    }
    admission: list[float] = []
    t0 = time.perf_counter()
    for r in range(a.rounds):  # the engines alternate, so drift hits both alike
        for kind in ("stock", "steerserve") if r % 2 == 0 else ("steerserve", "stock"):
            got, us = one_engine(kind, model, r, a)
            admission += [] if us is None else [us]
            for arm, by_c in got.items():
                for key, v in by_c.items():
                    tps_[arm][key].append(v)
            print(json.dumps({"round": r, "engine": kind, "elapsed_s": time.perf_counter() - t0}))
    ratios = {
        name: {f"c{c}": harness.ratio_summary(tps_[num][f"c{c}"], tps_[den][f"c{c}"])
               for c in a.concurrency}
        for name, (num, den) in RATIOS.items() if num in tps_ and den in tps_
    }  # fmt: skip
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else harness.cpu_info()
    summary = {
        "model": Path(model).name, "dtype": a.dtype, "compiled": a.compile, "device": device,
        "rounds": a.rounds, "tokens": a.tokens, "repeats": a.repeats, "concurrency": a.concurrency,
        "threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"), "dry_run": a.dry_run,
        "tokens_per_s": tps_, "ratios": ratios, "admission_us": statistics.median(admission),
        "wall_s": time.perf_counter() - t0,
    }  # fmt: skip
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(summary, indent=2))
    print("\n| ratio | " + " | ".join(f"{c} concurrent (median, 95 % CI)" for c in a.concurrency)
          + " |\n|---|" + "---|" * len(a.concurrency))  # fmt: skip
    for name, by_c in ratios.items():
        print(f"| {name} | " + " | ".join(harness.fmt(v) for v in by_c.values()) + " |")
    print(f"\nadmission per request: {summary['admission_us']:.1f} µs; written: {a.out}")


if __name__ == "__main__":
    main()
