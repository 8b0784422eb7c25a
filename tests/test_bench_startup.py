"""``bench/startup.py --dry-run`` (issue 48) on the tiny model: stock vLLM and ``steerserve serve``
each start on the same checkpoint, and the JSON carries each arm's time to ready, its memory by
process role and the ratios with intervals. Not timed: a dry run's numbers mean nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
from _bench import dry_run


@pytest.mark.slow
def test_dry_run_starts_both_and_writes_ratios(tiny_llama: Path, tmp_path: Path) -> None:
    res = dry_run("startup.py", tiny_llama, tmp_path / "startup.json")
    assert (res["rounds"], res["dtype"], res["model"]) == (1, "float32", tiny_llama.name)
    for arm in ("stock", "steerserve"):
        (run,) = res["runs"][arm]
        assert run["ready_s"] > 0
        rss = run["rss_mib"]
        # three processes each, as served: the server, its EngineCore, the worker
        assert all(rss[role] > 50 for role in ("front end", "EngineCore", "worker")), rss
        assert rss["total"] == pytest.approx(sum(v for k, v in rss.items() if k != "total"))
        # the front end's memory by kind, read from /proc: heap and mapped files, with the maps
        split = run["front_end"]
        assert split["anon"] > 20 and split["file"] > 20, split
        assert sum(split["maps"].values()) <= split["anon"] + split["file"] + 1, split
    keys = ("front end", "EngineCore", "worker", "total", "front end anon", "front end file")
    for key in ("ready", *keys):
        r = res["ratios"][key]
        lo, hi = r["ci95"]
        assert r["median"] > 0 and lo <= r["median"] <= hi
