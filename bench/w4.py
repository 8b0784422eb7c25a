"""4-bit weights vs full precision on this CPU: decode speed beside each arm's bandwidth floor.

Decode on a CPU reads every weight once per step, so the floor of a lone decode step is the bytes
its weights hold divided by the memory bandwidth. This run measures the bandwidth (a torch sum over
1 GiB on every core, best of five), then, each arm in its own process (one engine at a time) and
arms alternating over ``--cycles``:

* single-stream decode ms/token: one request, ``--tokens`` greedy tokens minus a 1-token request's
  time (its prefill), divided by the tokens after the first; the median over ``--rounds``;
* burst tokens/s: ``--batch`` concurrent requests of ``--tokens`` tokens;
* worker memory (resident, the process and its children) and engine init time.

Arms are ``<weights>:<dtype>``: ``full`` is the converted checkpoint, ``w4`` its 4-bit sibling
(steerserve.models.quantize) through vLLM's default kernel, ``w4a16`` the same checkpoint with
``VLLM_CPU_INT4_W4A8=0``; dtype is what vLLM computes in (4-bit weights need bfloat16 or float16).
vLLM's default on an AMX CPU in bfloat16 is ``int4_scaled_mm_cpu``, which also quantizes each
token's activations to int8 ("w4a8"); elsewhere, or with that variable off, ``cpu_gemm_wna16``
(16-bit activations, its "amx" or "vec" path). Each row names the kernel that ran.
The floor of each arm is computed from the bytes a decode step reads: every tensor but the token
embedding (a lookup reads single rows), in the dtype it is held in at serving time.

    .venv/bin/python bench/w4.py                                   # markdown table
    .venv/bin/python bench/w4.py --arms full:float32,w4:bfloat16 --cycles 2 --write-docs
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import harness

from steerserve.engine.cpu import W4A8_ENV

DEFAULT_ARMS = "full:float32,full:bfloat16,w4:bfloat16"
SIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
#: weights -> extra environment of its child (vLLM reads W4A8_ENV at weight loading)
WEIGHTS = {"full": {}, "w4": {}, "w4a16": {W4A8_ENV: "0"}}


def bandwidth_gbs(gib: int = 1, repeats: int = 5) -> float:
    """Read bandwidth in GB/s: a float32 sum over ``gib`` GiB, every core, best of ``repeats``."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    x = torch.ones(gib << 28, dtype=torch.float32)
    x.sum()
    best = min(_timed(lambda: x.sum()) for _ in range(repeats))
    return x.numel() * 4 / best / 1e9


def _timed(fn) -> float:  # noqa: ANN001
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def step_bytes(folder: Path, dtype: str) -> int:
    """Bytes one decode step reads from ``folder``'s weights served in ``dtype``: integer
    tensors as stored, float ones in ``dtype``; the token embedding left out unless the output
    layer is tied to it."""
    from safetensors import safe_open

    cfg = json.loads((folder / "config.json").read_text())
    tied = cfg.get("tie_word_embeddings", False)
    total = 0
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as s:
            for k in s.keys():
                if k.endswith("embed_tokens.weight") and not tied:
                    continue
                sl = s.get_slice(k)
                n = 1
                for d in sl.get_shape():
                    n *= d
                stored = sl.get_dtype()
                size = 4 if stored in ("I32", "F32") else 2
                total += n * (size if stored.startswith("I") else SIZE[dtype])
    return total


def folder_of(model: str, weights: str) -> Path:
    from steerserve.models import resolve_model, w4_dir

    path = Path(resolve_model(model))
    if weights not in WEIGHTS:
        raise SystemExit(f"unknown weights {weights!r}: one of {', '.join(WEIGHTS)}")
    if weights == "full":
        return path
    w4 = w4_dir(path)
    if w4 is None:
        raise SystemExit(f"{path} has no 4-bit checkpoint")
    return w4


def arm(spec: str, args: argparse.Namespace) -> dict:
    from vllm import SamplingParams

    from steerserve.engine.api import EngineConfig, SteerEngine

    weights, dtype = spec.split(":")
    folder = folder_of(args.model, weights)
    t0 = time.perf_counter()
    eng = SteerEngine(
        EngineConfig(
            model=str(folder),
            dtype=dtype,
            max_model_len=512,
            max_num_seqs=args.batch,
            kv_cache_memory_bytes=512 << 20,
            enforce_eager=True,
            enable_prefix_caching=False,  # every round does the same work
        )
    )
    init = time.perf_counter() - t0
    try:
        one = SamplingParams(max_tokens=1, temperature=0.0)
        many = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
        prompt = harness.prompts(1)
        batch = harness.prompts(args.batch)
        eng.generate(prompt, many)  # warm-up
        eng.generate(batch, many)
        ms, tps = [], []
        for _ in range(args.rounds):
            t1 = _timed(lambda: eng.generate(prompt, one))
            tn = _timed(lambda: eng.generate(prompt, many))
            ms.append((tn - t1) / (args.tokens - 1) * 1e3)
            t = _timed(lambda: eng.generate(batch, many))
            tps.append(args.batch * args.tokens / t)
        return {
            "init_s": init,
            "rss_gib": harness.rss_gib(),
            "ms_per_token": ms,
            "burst_tps": tps,
            "step_bytes": step_bytes(folder, dtype),
            "kernel": kernel(weights, dtype),
        }
    finally:
        eng.shutdown()


def kernel(weights: str, dtype: str) -> str:
    """The kernel these weights ran through (steerserve.engine.cpu.w4_kernel for 4-bit ones)."""
    from steerserve.engine.cpu import w4_kernel

    return "dense" if weights == "full" else w4_kernel(dtype, os.environ | WEIGHTS[weights])


def run_arm(spec: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", spec, "--model", args.model]
    cmd += ["--batch", str(args.batch), "--tokens", str(args.tokens), "--rounds", str(args.rounds)]
    env = os.environ | harness.bind_env("both") | WEIGHTS[spec.split(":")[0]]
    out, _ = harness.run_child(cmd, env, spec)
    print(f"done: {spec}", flush=True)
    return out


def table(results: dict[str, list[dict]], gbs: float) -> str:
    """One row per arm; the floor is the arm's step bytes over the measured bandwidth, and
    ``vs bf16 floor`` divides by the full-precision bfloat16 floor (issue 37's target <= 0.6)."""
    med = statistics.median
    full_bf16 = None
    for k, runs in results.items():
        if k.startswith("full:"):
            full_bf16 = runs[0]["step_bytes"] * SIZE["bfloat16"] // SIZE[k.split(":")[1]]
    md = [
        "| arm (weights:dtype) | kernel | init s | worker memory GiB | bytes/step GB | floor ms/token "
        "| decode ms/token (min-max) | / own floor | / bf16 floor | burst tok/s (min-max) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for k, runs in results.items():
        ms = [x for r in runs for x in r["ms_per_token"]]
        tps = [x for r in runs for x in r["burst_tps"]]
        b = runs[0]["step_bytes"]
        floor = b / gbs / 1e6
        bf16 = f"{med(ms) / (full_bf16 / gbs / 1e6):.2f}" if full_bf16 else "–"
        md.append(
            f"| {k} | {runs[0].get('kernel', '?')} | {med([r['init_s'] for r in runs]):.0f} "
            f"| {max(r['rss_gib'] for r in runs):.1f} | {b / 1e9:.2f} | {floor:.0f} "
            f"| **{med(ms):.0f}** ({min(ms):.0f}-{max(ms):.0f}) | {med(ms) / floor:.2f} | {bf16} "
            f"| **{med(tps):.1f}** ({min(tps):.1f}-{max(tps):.1f}) |"
        )
    return "\n".join(md) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="an embedded model (with a w4 sibling)")
    ap.add_argument("--arms", default=DEFAULT_ARMS, help="comma-separated weights:dtype")
    ap.add_argument("--cycles", type=int, default=1, help="alternations over all arms")
    ap.add_argument("--batch", type=int, default=16, help="concurrent requests of a burst")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per request")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per arm and cycle")
    ap.add_argument("--write-docs", action="store_true", help="record in docs/benchmarks.md")
    ap.add_argument("--label", default="4-bit weights (issue 37)", help="its subsection there")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(arm(args.child, args)), flush=True)
        return
    load0 = os.getloadavg()
    gbs = [bandwidth_gbs()]
    results: dict[str, list[dict]] = {}
    for _ in range(args.cycles):
        for a in [a for a in args.arms.split(",") if a]:
            results.setdefault(a, []).append(run_arm(a, args))
            gbs.append(bandwidth_gbs())  # between arms: the floor follows the machine's load
    load1 = os.getloadavg()
    flags = cpu_kind()
    md = table(results, statistics.median(gbs))
    meta = (
        f"`bench/w4.py --arms {args.arms} --cycles {args.cycles} --batch {args.batch} --tokens "
        f"{args.tokens} --rounds {args.rounds}`: model `{args.model}`, {platform.machine()} "
        f"({flags}), {os.cpu_count()} CPUs, both bound, {time.strftime('%Y-%m-%d')}; read "
        f"bandwidth {statistics.median(gbs):.1f} GB/s (median of {len(gbs)} samples, "
        f"{min(gbs):.1f}-{max(gbs):.1f}); load average (1/5 min) {load0[0]:.1f}/{load0[1]:.1f} "
        f"at start, {load1[0]:.1f}/{load1[1]:.1f} at end."
    )
    print(meta + "\n\n" + md)
    if args.write_docs:
        harness.write_docs("Chat model", f"{meta}\n\n{md}", args.label, "One subsection per run.")


def cpu_kind() -> str:
    from steerserve.engine.cpu import BF16_FLAGS, cpu_flags

    f = cpu_flags()
    native = [x for x in BF16_FLAGS if x in f]
    isa = "AVX-512" if "avx512f" in f else "AVX2" if "avx2" in f else "no AVX2"
    return f"{isa}, native bfloat16: {', '.join(native) or 'no'}"


if __name__ == "__main__":
    main()
