"""Engine overhead of the steering plugin, as ratios measured in one run (not a test).

Arms, same prompts, greedy, fixed output length:
* ``absent``  — a stock engine (no ``Steered<Arch>``; the plugin plays no part);
* ``idle``    — the steered engine, no request steered;
* ``steered`` — the same engine, every request steered with 2 entries.
``idle`` and ``steered`` alternate on one engine; the stock and the plugin engine alternate
(one engine at a time fits this machine), so drift hits every arm alike. Also measures the front-end
admission cost per request (validation + encoding + salt).

    python bench/overhead.py [--model PATH] [--cycles 2] [--rounds 3] [--batch 32] [--tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from steerserve.engine.api import SteerEngine

# vLLM's default multi-process mode, as served: single-process mode runs the CPU model far slower.


def _prompts(n: int) -> list[str]:
    base = [
        "The capital of France is",
        "フランスの首都は",
        "La capitale de l'Italie est",
        "독일의 수도는",
        "El idioma oficial de Brasil es",
        "中国的首都是",
        "The currency of Japan is the",
        "Die Hauptstadt von Spanien ist",
    ]
    return [f"{base[i % len(base)]} ({i})" for i in range(n)]


def _tps(eng, prompts, steering, sp) -> float:
    t = time.perf_counter()
    outs = eng.generate(prompts, sp, steering=steering)
    dt = time.perf_counter() - t
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


def _admission_us(eng, n: int = 20000) -> float:
    from vllm import SamplingParams

    from steerserve.engine.api import make_prompt, with_steering

    entries = _entries(eng)
    sp = SamplingParams(max_tokens=8)
    t = time.perf_counter()
    for i in range(n):
        p = eng.admission.prepare(entries)
        make_prompt(f"prompt {i}")
        with_steering(sp, p)
    return (time.perf_counter() - t) / n * 1e6


def _entries(eng) -> list[dict]:
    n = eng.shape.num_layers
    return [
        {
            "vector": "bench/a",
            "layer": n // 3,
            "scale": 2.0,
            "positions": "last_prompt_and_generated",
        },
        {"vector": "bench/b", "layer": (2 * n) // 3, "scale": 1.0, "positions": "all"},
    ]


def build_engine(
    model: str,
    batch: int,
    kv_cache_bytes: int,
    compiled: bool,
    steering: bool,
    dtype: str = "auto",
) -> SteerEngine:
    """The engine every arm runs: stock (``steering=False``) or the plugin's, same settings; no
    prefix caching, so every round does the same work; ``kv_cache_bytes`` 0: vLLM sizes it (GPU)."""
    from steerserve.engine.api import EngineConfig, SteerEngine

    return SteerEngine(
        EngineConfig(
            model=model,
            dtype=dtype,
            max_model_len=512,
            max_num_seqs=batch,
            kv_cache_memory_bytes=kv_cache_bytes or None,
            enforce_eager=not compiled,
            enable_prefix_caching=False,
            steering=steering,
        )
    )


def register_vectors(eng: SteerEngine) -> None:
    """The random vectors ``_entries`` names, seeded: every run steers with the same ones."""
    import torch

    g = torch.Generator().manual_seed(0)
    for name in ("bench/a", "bench/b"):
        eng.register_vector(name, torch.randn(eng.shape.hidden_size, generator=g))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--rounds", type=int, default=3, help="timed batches per engine start")
    ap.add_argument("--cycles", type=int, default=2, help="absent/plugin engine alternations")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    ap.add_argument("--compile", action="store_true", help="torch.compile instead of eager")
    args = ap.parse_args()

    import torch
    from vllm import SamplingParams

    from steerserve.models import resolve_model

    model = str(resolve_model(args.model))
    prompts = _prompts(args.batch)
    # no prefix caching: every round must do the same work
    sp = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)

    res: dict[str, list[float]] = {"absent": [], "idle": [], "steered": []}

    def build(steering: bool) -> SteerEngine:
        return build_engine(model, args.batch, args.kv_cache_bytes, args.compile, steering)

    def run_absent() -> None:
        eng = build(False)
        _tps(eng, prompts, None, sp)  # warm-up
        for _ in range(args.rounds):
            res["absent"].append(_tps(eng, prompts, None, sp))
        eng.shutdown()

    def run_plugin() -> float:
        eng = build(True)
        register_vectors(eng)
        steering = [_entries(eng)] * len(prompts)
        _tps(eng, prompts, None, sp)
        _tps(eng, prompts, steering, sp)
        for _ in range(args.rounds):
            res["idle"].append(_tps(eng, prompts, None, sp))
            res["steered"].append(_tps(eng, prompts, steering, sp))
        admission = _admission_us(eng)
        eng.shutdown()
        return admission

    for _ in range(args.cycles):  # engines alternate so that drift hits both arms alike
        run_absent()
        admission = run_plugin()

    med = {k: statistics.median(v) for k, v in res.items()}
    print(
        f"\nmodel {model}; batch {args.batch} x {args.tokens} new tokens; "
        f"{args.cycles} cycles x {args.rounds} rounds;"
    )
    print(
        f"{'compiled' if args.compile else 'eager'}; prefix caching off; torch threads "
        f"{torch.get_num_threads()}\n"
    )
    print("| arm | tokens/s (median) | min | max |")
    print("|---|---|---|---|")
    for k, v in res.items():
        print(f"| {k} | {med[k]:.1f} | {min(v):.1f} | {max(v):.1f} |")
    print("\n| ratio | value | target |")
    print("|---|---|---|")
    print(f"| idle / absent | {med['idle'] / med['absent']:.3f} | >= 0.99 |")
    print(f"| steered / idle (unsteered) | {med['steered'] / med['idle']:.3f} | >= 0.97 |")
    print(f"| admission per request | {admission:.1f} µs | < 200 µs |")


if __name__ == "__main__":
    main()
