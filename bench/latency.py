"""Latency parity with stock vLLM (issue 23): paired, interleaved, ratios in one run.

Arms, all on one checkpoint with the same engine settings (dtype, eager, max_model_len,
max_num_seqs, KV cache bytes, prefix caching, every core bound):

* ``stock``   — vLLM's own OpenAI server, plugins off (``VLLM_PLUGINS=none``), a subprocess;
* ``server``  — ``steerserve serve --steering off``, a subprocess;
* ``engine``  — steerserve's engine without the gateway: ``AsyncLLM`` with the plugin, in this
  process (server/backend.py's ``Backend``), token ids in as the server sends them;
* ``steered`` — the same engine, every request steered (one random vector of norm
  ``--vector-norm`` at the middle layer, positions ``all``).

Per round and arm, in the order A B C D, rotated every round so no arm always follows another:
``--requests`` sequential streamed 16-token completions (TTFT, mean inter-token latency, total),
as many collected ones (total), then a burst of ``--burst`` concurrent ``--burst-tokens``-token
completions (tokens/s). Greedy, ``ignore_eos``. Ratios: medians of per-round ratios (robust to
background load that drifts between rounds) with a bootstrap interval over rounds. ``server /
engine`` is what the HTTP gateway costs over its ``AsyncLLM``; ``steered / engine`` what steering
every request costs the engine.

    .venv/bin/python bench/latency.py                       # tiny 28-block Llama (seconds)
    .venv/bin/python bench/latency.py --model gemma-3-270m --rounds 6
    .venv/bin/python bench/latency.py --model default --sequential   # one server at a time
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import harness
import pyspy

from steerserve.engine.cpu import bind_all_cores

ARMS = ("stock", "server", "engine", "steered")
PROMPT = "The capital of France is Paris. The capital of Italy is Rome. The capital of Peru is"


# --- one request, by path ------------------------------------------------------------------------


async def http_one(c, tokens: int, stream: bool) -> tuple[float, float, list[float], int]:  # noqa: ANN001
    """(total s, TTFT s, inter-token gaps s, tokens) of one completion over HTTP."""
    body = {"model": "bench", "prompt": PROMPT, "max_tokens": tokens, "temperature": 0}
    body |= {"ignore_eos": True, "stream": stream}
    t0 = time.perf_counter()
    if not stream:
        r = await c.post("/v1/completions", json=body)
        r.raise_for_status()
        return time.perf_counter() - t0, 0.0, [], r.json()["usage"]["completion_tokens"]
    stamps: list[float] = []
    async with c.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"][0].get("text"):
                    stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return time.perf_counter() - t0, stamps[0] - t0, gaps, len(stamps)


class Direct:
    """The ``engine``/``steered`` arms: steerserve's Backend (AsyncLLM + plugin), no HTTP."""

    def tree(self) -> list:
        return self.procs

    def __init__(self, model: Path, a: argparse.Namespace) -> None:
        from steerserve.engine.api import EngineConfig
        from steerserve.server.backend import Backend

        bind_all_cores(os.environ, False, 1)
        self.backend = Backend(
            EngineConfig(
                model=str(model),
                dtype=a.dtype,
                max_model_len=a.max_model_len,
                max_num_seqs=a.max_num_seqs,
                kv_cache_memory_bytes=a.kv_cache_bytes,
            )
        )
        self.norm = a.vector_norm
        self.entries: list = []

    async def start(self) -> None:
        import psutil
        import torch

        from steerserve.engine.spec import SteeringEntry

        me = psutil.Process()
        before = {p.pid for p in me.children(recursive=True)}
        await self.backend.start()
        self.procs = [me] + [p for p in me.children(recursive=True) if p.pid not in before]
        self.ids = list(self.backend.tokenizer.encode(PROMPT))
        v = torch.randn(self.backend.shape.hidden_size, generator=torch.Generator().manual_seed(0))
        await self.backend.register("bench/latency", v / v.norm() * self.norm)
        mid = self.backend.shape.num_layers // 2
        self.entries = [SteeringEntry("bench/latency", mid, 1.0, "all")]

    async def one(self, steered: bool, tokens: int, stream: bool) -> tuple:
        import uuid

        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, output_kind=kind)
        prepared = self.backend.prepare(self.entries if steered else None)
        t0 = time.perf_counter()
        stamps, n = [], 0
        async for out in self.backend.generate(self.ids, sp, prepared, uuid.uuid4().hex):
            k = len(out.outputs[0].token_ids)
            n = k if not stream else n + k
            stamps += [time.perf_counter()] * k
        total = time.perf_counter() - t0
        gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False) if b > a]
        return total, (stamps[0] - t0) if stream else 0.0, gaps, n


# --- the rounds ----------------------------------------------------------------------------------


async def measure_arm(arm: str, target, a: argparse.Namespace, rnd: int) -> dict:  # noqa: ANN001
    """One round of one arm: streamed and collected single requests, then a burst."""
    import httpx

    if isinstance(target, Direct):
        steered = arm == "steered"

        async def call(tokens: int, stream: bool) -> tuple:
            return await target.one(steered, tokens, stream)
    else:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        client = httpx.AsyncClient(base_url=target.url, timeout=600, limits=limits)

        async def call(tokens: int, stream: bool) -> tuple:
            return await http_one(client, tokens, stream)

    try:
        await call(a.tokens, False)  # untimed: a freshly started server's first request
        res: dict = {"stream": [], "collected": []}
        procs = target.tree()
        spies = (
            []
            if not a.profile
            else [pyspy.Spy(p, Path(a.profile) / f"{arm}-{rnd}", i) for i, p in enumerate(procs)]
        )
        if spies:
            time.sleep(1.0)  # attached before the first request
        cpu0 = cpu_by_role(procs)
        for _ in range(a.requests):
            res["stream"].append(await call(a.tokens, True))
            res["collected"].append((await call(a.tokens, False))[0])
        cpu1 = cpu_by_role(procs)
        for spy in spies:
            spy.stop()
        res["cpu_ms"] = {k: 1e3 * (cpu1[k] - cpu0.get(k, 0.0)) / (2 * a.requests) for k in cpu1}
        t0 = time.perf_counter()
        burst = await asyncio.gather(*(call(a.burst_tokens, False) for _ in range(a.burst)))
        res["burst_tps"] = sum(b[3] for b in burst) / (time.perf_counter() - t0)
        return res
    finally:
        if not isinstance(target, Direct):
            await client.aclose()


def cpu_by_role(procs: list) -> dict[str, float]:
    """CPU seconds (user + system) by process: the first is the front end ("api"; in this
    process for the engine arms, with the client loop), the others by name (EngineCore, worker)."""
    out: dict[str, float] = {}
    for i, p in enumerate(procs):
        try:
            t = p.cpu_times()
            role = "api" if i == 0 else "".join(c for c in p.name() if not c.isdigit())
        except Exception:  # noqa: BLE001 (a process gone: nothing to count)
            continue
        out[role] = out.get(role, 0.0) + t.user + t.system
    return out


def summary(rounds: list[dict[str, dict]]) -> dict[str, dict[str, float]]:
    med = statistics.median

    def pct(xs: list[float], q: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]

    out: dict[str, dict[str, float]] = {}
    for arm in rounds[0]:
        rs = [r[arm] for r in rounds]
        coll = [x for r in rs for x in r["collected"]]
        st = [x for r in rs for x in r["stream"]]
        out[arm] = {
            "p50_s": med(coll),
            "p90_s": pct(coll, 0.9),
            "stream_p50_s": med([s[0] for s in st]),
            "ttft_ms": 1e3 * med([s[1] for s in st]),
            "itl_ms": 1e3 * med([g for s in st for g in s[2]] or [0.0]),
            "burst_tps": med([r["burst_tps"] for r in rs]),
            "cpu_ms": {k: med([r["cpu_ms"].get(k, 0.0) for r in rs]) for k in rs[0]["cpu_ms"]},
            # per-round medians, for paired ratios
            "_p50": [med(r["collected"]) for r in rs],
            "_burst": [r["burst_tps"] for r in rs],
        }
    return out


def report(s: dict, meta: str) -> str:
    md = [meta, ""]
    md.append("| arm | p50 s | p90 s | streamed p50 s | TTFT ms | ITL ms | burst tok/s |")
    md.append("|---|---|---|---|---|---|---|")
    for arm, v in s.items():
        md.append(
            f"| {arm} | {v['p50_s']:.3f} | {v['p90_s']:.3f} | {v['stream_p50_s']:.3f} "
            f"| {v['ttft_ms']:.1f} | {v['itl_ms']:.2f} | {v['burst_tps']:.1f} |"
        )
    md += ["", "CPU ms per single request (median over rounds), by process:", ""]
    for arm, v in s.items():
        md.append(f"- {arm}: " + ", ".join(f"{k} {x:.0f}" for k, x in v["cpu_ms"].items()))
    md += [
        "",
        "| ratio (paired: median over rounds [95 % bootstrap over rounds]) | p50 | burst tok/s "
        "| target |",
        "|---|---|---|---|",
    ]
    pairs = [("server", "stock", "p50 ≤ 1.05, burst ≥ 0.97"), ("engine", "stock", ""),
             ("server", "engine", "(the gateway)"), ("steered", "engine", "burst ≥ 0.97")]  # fmt: skip
    for num, den, target in pairs:
        if num in s and den in s:
            cells = []
            for key in ("_p50", "_burst"):
                r = harness.ratio_summary(s[num][key], s[den][key])
                cells.append(f"**{r['median']:.3f}** [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]")
            md.append(f"| {num} / {den} | {cells[0]} | {cells[1]} | {target} |")
    return "\n".join(md) + "\n"


async def run(a: argparse.Namespace) -> None:
    model = harness.model_dir(a.model)
    arms = [x for x in a.arms.split(",") if x]
    logs = Path(a.logs or tempfile.mkdtemp(prefix="steerserve-latency-"))
    logs.mkdir(parents=True, exist_ok=True)
    machine = harness.machine()  # at the start
    targets: dict[str, object] = {}
    direct = None
    try:
        if not a.sequential:  # all up at once; only one works at a time
            for arm in arms:
                if arm in ("stock", "server"):
                    targets[arm] = harness.serve_arm(arm, model, a, logs)
        if {"engine", "steered"} & set(arms):
            direct = Direct(model, a)
            await direct.start()
        rounds: list[dict[str, dict]] = []
        for i in range(a.rounds + 1):  # round 0 warms every path and is dropped
            order = arms[i % len(arms) :] + arms[: i % len(arms)]
            got: dict[str, dict] = {}
            for arm in order:
                if arm in ("engine", "steered"):
                    target = direct
                elif a.sequential:
                    target = harness.serve_arm(arm, model, a, logs)
                else:
                    target = targets[arm]
                try:
                    got[arm] = await measure_arm(arm, target, a, i)
                finally:
                    if a.sequential and arm in ("stock", "server"):
                        target.stop()
            print(f"round {i}: " + ", ".join(f"{k} {med_s(v)}" for k, v in got.items()), flush=True)
            if i:
                rounds.append({arm: got[arm] for arm in arms})
                if a.json:  # every round, so a stopped run keeps what it measured
                    Path(a.json).write_text(json.dumps({"rounds": rounds}, indent=1))
    finally:
        for t in targets.values():
            t.stop()
        if direct is not None:
            await direct.backend.shutdown()
    load1 = os.getloadavg()
    meta = (
        f"`bench/latency.py --model {a.model} --dtype {a.dtype} --rounds {a.rounds} "
        f"--requests {a.requests} --tokens {a.tokens} --burst {a.burst} --burst-tokens "
        f"{a.burst_tokens}{' --sequential' if a.sequential else ''}`; {machine} at "
        f"start, {load1[0]:.1f}/{load1[1]:.1f} at end; eager, KV cache {a.kv_cache_bytes >> 20} "
        f"MiB, every core bound; logs {logs}"
    )
    s = summary(rounds)
    print("\n" + report(s, meta))
    if a.profile:
        print("py-spy: ms of sampled (non-idle) Python stacks per single request")
        for arm in arms:
            folders = sorted(Path(a.profile).glob(f"{arm}-*"))
            folders = [f for f in folders if not f.name.endswith("-0")]
            per = 1e3 / (2 * a.requests * max(1, len(folders)))  # ms per single request
            for role, cats in pyspy.seconds(folders, pyspy.role_of).items():
                top = sorted(((k, v * per) for k, v in cats.items()), key=lambda kv: -kv[1])
                print(f"- {arm} / {role}: " + ", ".join(f"{k} {v:.1f}" for k, v in top))
    if a.json:
        Path(a.json).write_text(json.dumps({"meta": meta, "rounds": rounds}, indent=1))


def med_s(v: dict) -> str:
    return f"{statistics.median(v['collected']):.3f}s/{v['burst_tps']:.0f}tok/s"


def main() -> None:
    from steerserve.engine.cpu import serve_dtype

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="tiny, an embedded model name, or a folder")
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 where the CPU has it natively")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (after one warm-up)")
    ap.add_argument("--requests", type=int, default=3, help="single requests per arm and round")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--burst", type=int, default=16)
    ap.add_argument("--burst-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--kv-cache-bytes", type=int, default=256 << 20)
    ap.add_argument("--vector-norm", type=float, default=10.0)
    ap.add_argument("--sequential", action="store_true", help="one server at a time (big models)")
    ap.add_argument("--logs", help="server logs here (default: a temp dir)")
    ap.add_argument("--json", help="write every round here")
    ap.add_argument("--profile", help="py-spy every arm's single requests into this folder")
    ap.add_argument(
        "--summarize",
        nargs="+",
        help="only print the tables of --json files (a stopped run; several: their rounds pooled, "
        "arms common to all)",
    )
    a = ap.parse_args()
    if a.dtype == "auto":
        a.dtype = "bfloat16" if serve_dtype("auto", False) == "auto" else "float32"
    if a.summarize:
        rounds = [r for f in a.summarize for r in json.loads(Path(f).read_text())["rounds"]]
        arms = [arm for arm in rounds[0] if all(arm in r for r in rounds)]
        rounds = [{arm: r[arm] for arm in arms} for r in rounds]
        print(report(summary(rounds), f"{' + '.join(a.summarize)}: {len(rounds)} rounds"))
        return
    asyncio.run(run(a))


if __name__ == "__main__":
    main()
