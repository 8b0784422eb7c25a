"""The embedded chat model on this machine's CPU: speed by arm, ratios measured in one run.

Each arm runs in its own process (one engine at a time; vLLM reads its CPU binding variables once
per process), and arms alternate over ``--cycles`` so load drift hits them alike:

* ``engine:<dtype>:<eager|compile>:<bind>`` — ``SteerEngine``, batch × tokens greedy, unsteered
  and steered rounds alternating (one random vector of norm ``--vector-norm`` at the middle
  layer, every request); tokens/s of each, their ratio, engine init time, worker memory;
* ``server:<dtype>:<eager|compile>:<bind>`` — ``steerserve serve`` (no vectors), chat
  completions: p50 latency of a 16-token reply one at a time, tokens/s of ``--batch`` concurrent
  replies, and the time to ready (warm start);
* ``start`` (``--first-start``) — assemble + convert into an empty cache, then the warm check.

``bind``: ``auto`` is vLLM's default on CPU (the worker computes on core 0 and leaves core 1 to
the front end); ``both`` binds the worker's OpenMP threads to every core
(``VLLM_CPU_OMP_THREADS_BIND=0-N``).

    .venv/bin/python bench/chat_model.py                          # default arms, markdown tables
    .venv/bin/python bench/chat_model.py --arms server:auto:eager:auto,server:auto:eager:both
    .venv/bin/python bench/chat_model.py --first-start --write-docs --label 'first start'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness

CHAT = [
    "フランスの首都はどこですか？",
    "What is the capital of Peru?",
    "¿Quién escribió «Cien años de soledad»?",
    "대한민국의 수도는 어디입니까?",
    "中国的首都是哪里？",
    "Quelle est la capitale de l'Italie ?",
]
DEFAULT_ARMS = (
    "engine:auto:eager:auto,engine:float32:eager:auto,engine:auto:compile:auto,"
    "server:auto:eager:auto,server:auto:eager:both"
)


# --- arms (child processes) --------------------------------------------------------------------


def arm_engine(model: str, dtype: str, compiled: bool, args: argparse.Namespace) -> dict:
    import torch
    from vllm import SamplingParams

    from steerserve.engine.api import EngineConfig, SteerEngine

    t0 = time.perf_counter()
    eng = SteerEngine(
        EngineConfig(
            model=model,
            dtype=dtype,
            max_model_len=512,
            max_num_seqs=args.batch,
            kv_cache_memory_bytes=512 << 20,
            enforce_eager=not compiled,
            enable_prefix_caching=False,  # every round does the same work
        )
    )
    init = time.perf_counter() - t0
    try:
        g = torch.Generator().manual_seed(0)
        v = torch.randn(eng.shape.hidden_size, generator=g)
        eng.register_vector("bench/chat", v / v.norm() * args.vector_norm)
        entry = {"vector": "bench/chat", "layer": eng.shape.num_layers // 2, "scale": 1.0}
        prompts = harness.prompts(args.batch)
        steering = [[entry]] * len(prompts)
        sp = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
        harness.burst_tps(eng, prompts, None, sp)  # warm-up
        harness.burst_tps(eng, prompts, steering, sp)
        res: dict[str, list[float]] = {"unsteered": [], "steered": []}
        for i in range(args.rounds):
            order = ("unsteered", "steered") if i % 2 == 0 else ("steered", "unsteered")
            for arm in order:
                res[arm].append(
                    harness.burst_tps(eng, prompts, steering if arm == "steered" else None, sp)
                )
        return {"init_s": init, "rss_gib": harness.rss_gib(), **res}
    finally:
        eng.shutdown()


def arm_server(model: str, dtype: str, compiled: bool, args: argparse.Namespace) -> dict:
    import httpx

    def body(i: int, tokens: int) -> dict:
        msg = [{"role": "user", "content": CHAT[i % len(CHAT)]}]
        return {"model": "bench", "messages": msg, "max_tokens": tokens, "temperature": 0}

    async def burst(c: httpx.AsyncClient, n: int) -> float:
        async def one(i: int) -> int:
            r = await c.post(
                "/v1/chat/completions", json=body(i, args.tokens) | {"ignore_eos": True}
            )
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        t = time.perf_counter()
        toks = await asyncio.gather(*(one(i) for i in range(n)))
        return sum(toks) / (time.perf_counter() - t)

    async def run(url: str) -> dict:
        async with httpx.AsyncClient(base_url=url, timeout=600) as c:
            lat, answers = [], []
            for i in range(args.requests + 1):
                t = time.perf_counter()
                r = await c.post("/v1/chat/completions", json=body(i, 16) | {"ignore_eos": True})
                r.raise_for_status()
                if i:  # the first request warms the path
                    lat.append(time.perf_counter() - t)
                answers.append(r.json()["choices"][0]["message"]["content"])
            tps = [await burst(c, args.batch) for _ in range(args.rounds)]
            r = await c.post("/v1/chat/completions", json=body(0, 32))
            return {"latency_16": lat, "burst_tps": tps, "sample": r.json()}

    with tempfile.TemporaryDirectory() as tmp:
        flags = harness.engine_flags(dtype, 512, 64, 256 << 20, compiled)
        flags += ["--steering", "off", "--vectors-dir", tmp, "--log-level", "warning"]
        srv = harness.serve("steerserve", model, flags, Path(tmp), wait=False, bind=False)
        try:  # the binding is the arm's: its environment came from the parent
            ready = srv.wait_ready()
            out = asyncio.run(run(srv.url))
            return {"ready_s": ready, "rss_gib": sum(srv.rss_mib().values()) / 1024, **out}
        finally:
            srv.stop()


def arm_start(model: str, cache: str | None) -> dict:
    """First start (assemble + convert + checks), then a warm resolve, into ``cache`` (default: a
    tmp dir, removed after); a conversion already there is replaced."""
    from steerserve import models

    name = models.DEFAULT_MODEL if model == "default" else model
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["STEERSERVE_CACHE"] = cache or tmp
        shutil.rmtree(models.model_dir(name), ignore_errors=True)
        t = time.perf_counter()
        path = models.resolve_model(name)
        first = time.perf_counter() - t
        t = time.perf_counter()
        models.resolve_model(name)
        warm = time.perf_counter() - t
        marker = models.read_marker(path)
    return {"first_s": first, "warm_s": warm, "marker": marker}


def child(spec: str, args: argparse.Namespace) -> None:
    if spec == "start":
        out = arm_start(args.model, args.cache)
    else:
        from steerserve.models import resolve_model

        kind, dtype, mode, _bind = spec.split(":")
        model = str(resolve_model(args.model))
        fn = arm_engine if kind == "engine" else arm_server
        out = fn(model, dtype, mode == "compile", args)
    print("RESULT " + json.dumps(out), flush=True)


# --- the parent: run arms, tabulate -------------------------------------------------------------


def run_arm(spec: str, args: argparse.Namespace) -> dict:
    bind = "auto" if spec == "start" else spec.split(":")[3]
    env = os.environ | harness.bind_env(bind)
    cmd = [sys.executable, __file__, "--child", spec, "--model", args.model]
    cmd += ["--batch", str(args.batch), "--tokens", str(args.tokens), "--rounds", str(args.rounds)]
    cmd += ["--requests", str(args.requests), "--vector-norm", str(args.vector_norm)]
    cmd += ["--cache", args.cache] if args.cache else []
    t = time.perf_counter()
    out, log = harness.run_child(cmd, env, spec)
    out["wall_s"] = time.perf_counter() - t
    found = re.findall(r"core ids=\[[\d, ]*\]|reserved_cpus=\[[\d, ]*\]", log)
    out["binding"] = ", ".join(dict.fromkeys(found))
    print(f"done: {spec} in {out['wall_s']:.0f} s", flush=True)
    return out


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def tables(results: dict[str, list[dict]]) -> str:
    md = []
    engine = {k: v for k, v in results.items() if k.startswith("engine:")}
    if engine:
        md.append(
            "| arm (dtype, mode, bind) | init s | memory GiB | unsteered tok/s | steered tok/s "
            "| steered / unsteered |\n|---|---|---|---|---|---|"
        )
        for k, runs in engine.items():
            u = _med([x for r in runs for x in r["unsteered"]])
            s = _med([x for r in runs for x in r["steered"]])
            ratio = _med([_med(r["steered"]) / _med(r["unsteered"]) for r in runs])
            md.append(
                f"| {k[7:]} | {_med([r['init_s'] for r in runs]):.0f} "
                f"| {max(r['rss_gib'] for r in runs):.1f} | {u:.1f} | {s:.1f} | **{ratio:.3f}** |"
            )
    server = {k: v for k, v in results.items() if k.startswith("server:")}
    if server:
        md.append(
            "\n| arm (dtype, mode, bind) | ready s (warm start) | memory GiB "
            "| p50 16-token chat reply s | p95 s | concurrent tok/s |\n|---|---|---|---|---|---|"
        )
        for k, runs in server.items():
            lat = sorted(x for r in runs for x in r["latency_16"])
            p95 = lat[min(len(lat) - 1, round(0.95 * (len(lat) - 1)))]
            md.append(
                f"| {k[7:]} | {_med([r['ready_s'] for r in runs]):.0f} "
                f"| {max(r['rss_gib'] for r in runs):.1f} | **{_med(lat):.2f}** | {p95:.2f} "
                f"| {_med([x for r in runs for x in r['burst_tps']]):.1f} |"
            )
    if "start" in results:
        (r,) = results["start"][:1]
        md.append(
            f"\nFirst start (assemble + convert + checks, empty cache): **{r['first_s']:.0f} s**; "
            f"warm check of the converted cache: {r['warm_s'] * 1e3:.0f} ms. Conversion check: "
            f"`{json.dumps(r['marker']['check'])}`."
        )
    return "\n".join(md) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="model name or folder (default: chat)")
    ap.add_argument("--arms", default=DEFAULT_ARMS, help="comma-separated arm specs")
    ap.add_argument("--cycles", type=int, default=1, help="alternations over all arms")
    ap.add_argument("--batch", type=int, default=8, help="requests per batch / burst")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per batched request")
    ap.add_argument("--rounds", type=int, default=4, help="timed batches per arm and cycle")
    ap.add_argument("--requests", type=int, default=10, help="sequential 16-token chat replies")
    ap.add_argument("--vector-norm", type=float, default=10.0, help="steering vector norm")
    ap.add_argument("--first-start", action="store_true", help="also time a conversion")
    ap.add_argument("--cache", help="--first-start converts into this cache (default: a tmp dir)")
    ap.add_argument("--write-docs", action="store_true", help="record in docs/benchmarks.md")
    ap.add_argument("--label", default="latest run", help="its subsection there")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args)
        return

    machine = harness.machine()
    arms = [a for a in args.arms.split(",") if a]
    results: dict[str, list[dict]] = {}
    if args.first_start:
        results["start"] = [run_arm("start", args)]
    for _ in range(args.cycles):
        for a in arms:
            results.setdefault(a, []).append(run_arm(a, args))
    for k, runs in results.items():
        print(f"{k}: {runs[0].get('binding')}")
        if k.startswith("server:"):
            print(f"  sample: {runs[0]['sample']['choices'][0]}")
    load1 = os.getloadavg()
    meta = (
        f"`bench/chat_model.py --arms {args.arms} --cycles {args.cycles} --batch {args.batch} "
        f"--tokens {args.tokens} --rounds {args.rounds} --requests {args.requests}"
        f"{' --first-start' if args.first_start else ''}`: model `{args.model}`, "
        f"{machine} at start, {load1[0]:.1f}/{load1[1]:.1f} at end. "
        "Engine rows: batch × tokens greedy (ignore_eos), prefix caching off, vLLM's "
        "multi-process mode; steered = every request, one random vector of norm "
        f"{args.vector_norm:g} at the middle layer. Server rows: chat completions through HTTP."
    )
    md = tables(results)
    print("\n" + meta + "\n\n" + md)
    if args.write_docs:
        harness.write_docs("Chat model", f"{meta}\n\n{md}", args.label, "One subsection per run.")


if __name__ == "__main__":
    main()
