"""``bench/bench_serve.py``'s bookkeeping (issue 60), without servers: a round counts only when
every server of it ran, runs pool with their rounds renumbered, steered arms are read against
``off`` in the same round and ``off`` against stock, and no two workloads share prompts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import bench_serve  # noqa: E402


def _server(r: int, kind: str, **tps: float) -> dict:
    return {"round": r, "server": kind, "passes": []} | {
        arm: {"c16": {"output_throughput": v}} for arm, v in tps.items()
    }


def test_whole_rounds_only_and_paired_ratios() -> None:
    rounds = [
        _server(0, "stock", stock=100.0),
        _server(0, "steerserve", off=99.0, on=97.02),
        _server(1, "steerserve", off=110.0, on=88.0),  # round 1's stock never ran
    ]
    tps = bench_serve.throughputs(rounds)
    assert tps == {"stock": {"c16": [100.0]}, "off": {"c16": [99.0]}, "on": {"c16": [97.02]}}
    ratios = bench_serve.summarise(tps, ["off", "on"], [16])
    assert ratios["on/off c16"]["per_round"] == pytest.approx([0.98])
    assert ratios["off/stock c16"]["median"] == pytest.approx(0.99)


def test_runs_pool_with_rounds_renumbered(tmp_path: Path) -> None:
    files = []
    for i, (off, on) in enumerate([(100.0, 90.0), (100.0, 100.0), (100.0, 99.0)]):
        f = tmp_path / f"run{i}.json"
        rounds = [_server(0, "stock", stock=100.0), _server(0, "steerserve", off=off, on=on)]
        f.write_text(json.dumps({"rounds": rounds, "workload": {"arms": ["off", "on"],
                                                                 "concurrency": [16]}}))  # fmt: skip
        files.append(str(f))
    r = bench_serve.pooled(files)["ratios"]["on/off c16"]
    assert r["per_round"] == pytest.approx([0.9, 1.0, 0.99])
    assert r["median"] == pytest.approx(0.99) and r["ci95"][0] <= 0.99 <= r["ci95"][1]


def test_every_workload_of_a_run_has_its_own_prompts() -> None:
    seeds = [
        bench_serve.seed(r, i, arm, c)
        for r in range(5)
        for i in range(-1, 4)
        for arm in (*bench_serve.ARMS, "stock")
        for c in (1, 16)
    ]
    assert len(seeds) == len(set(seeds))
