"""``bench/overhead.py --dry-run --no-compile`` (issues 7, 48) on the tiny model: every arm runs,
and the JSON carries each ratio's median and interval at every concurrency and the admission
cost. Eager: compiling the two engines was 46 s of the test's 117 s, and compiled against eager
is test_engine_compile's question. Not timed: the numbers of a dry run mean nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
from _bench import dry_run


@pytest.mark.slow
def test_dry_run_writes_ratios_with_intervals(tiny_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    res = dry_run("overhead.py", tiny_llama, out, "--no-compile", "--kv-cache-bytes", str(64 << 20))
    assert (res["rounds"], res["tokens"], res["dry_run"], res["compiled"]) == (1, 4, True, False)
    keys = [f"c{c}" for c in res["concurrency"]]
    assert keys == ["c1", "c16"]
    for arm in ("stock", "idle", "add", "ablate"):
        assert all(len(res["tokens_per_s"][arm][k]) == 1 for k in keys), arm
    assert set(res["ratios"]) == {"idle/stock", "add/idle", "ablate/idle"}
    for by_c in res["ratios"].values():
        for k in keys:
            r = by_c[k]
            lo, hi = r["ci95"]
            assert r["median"] > 0 and lo <= r["median"] <= hi and len(r["per_round"]) == 1
    assert 0 < res["admission_us"] < 1e5
