"""GPU checks of the steering plugin that the CPU tests cannot make (run by ``bench/gpu_check.sh``).

For each runner (Model Runner V2, the GPU default; and V1 via ``VLLM_USE_V2_MODEL_RUNNER=0``), on a
tiny random Llama in float32 with torch.compile + CUDA graphs (vLLM's defaults, not eager):
1. a mixed batch (steered / unsteered, different layers, scales, positions, prompt lengths) equals
   each request run alone, and unsteered requests equal a stock engine's output;
2. decode batch sizes at and between CUDA-graph capture sizes (padding tail) and above the largest
   captured size (eager fallback) give the same tokens as solo runs;
3. greedy tokens match the transformers forward-hook oracle on the GPU;
4. scale 0 equals unsteered.
Prints one PASS/FAIL line per check and exits non-zero on any failure.

    python bench/gpu_check.py --runner v2|v1 [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

MAX_TOKENS = 12


def _prompts(n: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [
        [1] + torch.randint(4, 250, (int(3 + (i * 7) % 40),), generator=g).tolist()
        for i in range(n)
    ]


def _run(eng, prompts, steering):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in eng.generate(prompts, sp, steering=steering)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runner", choices=["v1", "v2"], required=True)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    from steerserve.engine.api import EngineConfig, SteerEngine
    from steerserve.engine.spec import SteeringEntry
    from steerserve.reference import greedy
    from steerserve.tiny import build_tiny_model

    model = build_tiny_model(Path(tempfile.mkdtemp()) / "llama", "llama")
    g = torch.Generator().manual_seed(0)
    vecs = {n: torch.randn(64, generator=g) * 1.5 for n in ("alpha", "beta")}
    results: dict[str, object] = {"runner": args.runner}
    failures: list[str] = []

    def check(name: str, ok: bool, detail: str = "") -> None:
        print(f"{'PASS' if ok else 'FAIL'} [{args.runner}] {name} {detail}", flush=True)
        results[name] = ok
        if not ok:
            failures.append(name)

    def cfg(steering: bool) -> EngineConfig:
        return EngineConfig(
            model=str(model),
            dtype="float32",
            max_model_len=512,
            max_num_seqs=256,
            kv_cache_memory_bytes=None,
            gpu_memory_utilization=0.3,
            enforce_eager=False,
            steering=steering,
        )

    mixed = [
        None,
        [{"vector": "alpha", "layer": 1, "scale": 2.0, "positions": "all"}],
        [{"vector": "beta", "layer": 2, "scale": -1.5, "positions": "last_prompt_and_generated"}],
        [
            {"vector": "alpha", "layer": 0, "scale": 1.0, "positions": "all"},
            {"vector": "beta", "layer": 3, "scale": 2.5, "positions": "generated"},
        ],
        None,
        [{"vector": "beta", "layer": 1, "scale": 3.0, "positions": "generated"}],
    ]
    base = _prompts(6, 1)
    sizes = [1, 3, 4, 7, 8, 13, 16, 24, 33, 64, 100, 256]  # around and above capture sizes

    t = time.time()
    stock = SteerEngine(cfg(False))
    stock_out = _run(stock, base, None)
    stock_sizes = {n: _run(stock, _prompts(n, 100 + n), None) for n in sizes}
    stock.shutdown()
    del stock
    torch.cuda.empty_cache()

    eng = SteerEngine(cfg(True))
    results["init_s"] = round(time.time() - t, 1)
    for n, v in vecs.items():
        eng.register_vector(n, v)
    batch = _run(eng, base, mixed)
    solo = [_run(eng, [p], [s])[0] for p, s in zip(base, mixed, strict=True)]
    check("mixed batch == solo", batch == solo)
    check(
        "unsteered == stock engine",
        all(batch[i] == stock_out[i] for i, s in enumerate(mixed) if s is None),
    )
    check(
        "steering changes outputs", any(b != stock_out[i] for i, b in enumerate(batch) if mixed[i])
    )
    zero = [[{"vector": "alpha", "layer": 1, "scale": 0.0, "positions": "all"}]] * len(base)
    check("scale 0 == unsteered", _run(eng, base, zero) == _run(eng, base, None))

    for n in sizes:  # half steered, half not; decode batches of exactly n requests
        ps = _prompts(n, 100 + n)
        st = [mixed[1] if i % 2 else None for i in range(n)]
        out = _run(eng, ps, st)
        ok_unsteered = all(out[i] == stock_sizes[n][i] for i in range(0, n, 2))
        ok_solo = all(out[i] == _run(eng, [ps[i]], [st[i]])[0] for i in range(1, min(n, 9), 2))
        check(f"batch {n}: unsteered == stock, steered == solo", ok_unsteered and ok_solo)

    hf = (
        __import__("transformers")
        .AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        .cuda()
    )
    ref_ok = True
    for p, s in zip(base, mixed, strict=True):
        entries = [SteeringEntry(**e) for e in s or []]
        ref, _ = greedy(hf, p, MAX_TOKENS, entries, {k: v.cuda() for k, v in vecs.items()})
        ref_ok &= ref == _run(eng, [p], [s])[0]
    check("tokens == transformers oracle (cuda)", ref_ok)
    results["worker_info"] = eng.worker_info()
    eng.shutdown()

    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"gpu_check_{args.runner}.json").write_text(
            json.dumps(results, indent=2, default=str)
        )
    print(f"[{args.runner}] {len(failures)} failed: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
