"""Start-up (issue 48): warm time to ready and resident memory, stock vLLM vs ``steerserve serve``.

Both arms serve one checkpoint with the same engine flags (dtype, max_model_len, max_num_seqs,
KV cache bytes, eager, every core bound), one at a time, their order alternating every round:

* ``stock``      — ``vllm serve``'s OpenAI server (``VLLM_PLUGINS=none``); ready = first 200 on
  ``/health`` (vLLM binds its port only after the engine has loaded);
* ``steerserve`` — ``steerserve serve MODEL`` as a user runs it: its shipped vectors for that model
  (fingerprints checked), steering ``auto``; ready = first 200 on ``/ready`` (its ``/health`` answers
  while the engine loads).

Warm: the embedded model is converted once before the first round (that cost is the first
start's, not measured here), and each arm starts once uncounted (``--warmup``), so the first
counted start does not read the checkpoint from disk while the others read the page cache.
Time is from ``Popen`` to ready; memory is each process's RSS once ready, by role: ``front end``
(the server process), ``EngineCore``, ``worker`` (every other process of the tree: the worker
EngineCore starts, the resource tracker), and their total; the front end's also split into heap
and mapped files (:func:`front_end_split`). Ratios steerserve/stock per round, their median and
seeded 95 % bootstrap interval (harness.py's).

    python bench/startup.py --model default --rounds 3 --out out/startup.json
    python bench/startup.py --dry-run      # the tiny model, 1 round: does it run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import harness

ARMS = ("stock", "steerserve")
ROLES = ("front end", "EngineCore", "worker")
SPLIT = {"front end anon": "anon", "front end file": "file"}  # the front end's RSS, by kind


def front_end_split(pid: int, top: int = 12) -> dict:
    """Where the front end's resident memory is (issue 48: what steerserve adds beyond stock):
    ``anon`` (the heap: objects it holds), ``file`` (mapped libraries and files, vLLM's
    shared-memory queues among them: what it loads as native code), and its ``top`` mappings."""
    sizes: dict[str, int] = {}
    name, anon = "[anon]", 0
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():  # one read: one snapshot
        head = line.split()
        if head and not head[0].endswith(":"):  # a mapping's header: address perms ... [path]
            name = head[5] if len(head) > 5 else "[anon]"
        elif head and head[0] == "Rss:":
            sizes[name] = sizes.get(name, 0) + int(head[1])
        elif head and head[0] == "Anonymous:":
            anon += int(head[1])
    mib = lambda kib: round(kib / 1024, 1)  # noqa: E731
    return {
        "anon": mib(anon),
        "file": mib(sum(sizes.values()) - anon),
        "maps": {k: mib(v) for k, v in sorted(sizes.items(), key=lambda kv: -kv[1])[:top]},
    }


def one_start(arm: str, model: str, ckpt: Path, dtype: str, a, logs: Path) -> dict:  # noqa: ANN001
    """One start of ``arm`` to ready, its memory by role once ready; then stopped."""
    flags = harness.engine_flags(dtype, a.max_model_len, a.max_num_seqs, a.kv_bytes)
    p = harness.serve(arm, ckpt if arm == "stock" else model, flags, logs, wait=False)
    try:
        ready = p.wait_ready()
        time.sleep(1)  # let the last allocations of the start settle
        rss = p.rss_mib()
        split = front_end_split(p.proc.pid)
        return {"ready_s": ready, "rss_mib": rss | {"total": sum(rss.values())}, "front_end": split}
    finally:
        p.stop()


def _ratio(series: dict, key: str) -> dict | None:
    """steerserve/stock per round: median and interval (None where stock has no such process)."""
    if not all(series["stock"][key]):
        return None
    return harness.ratio_summary(series["steerserve"][key], series["stock"][key])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="embedded model name, folder, or tiny")
    ap.add_argument("--dtype", default="auto", help="auto: steerserve's choice, given to both")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--warmup", action=argparse.BooleanOptionalAction, default=True,
        help="start each arm once first, not counted",
    )  # fmt: skip
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--kv-bytes", type=int, default=1 << 30)
    ap.add_argument("--out", type=Path, default=Path("out/startup.json"))
    ap.add_argument("--dry-run", action="store_true", help="the tiny model, 1 round")
    a = ap.parse_args()
    if a.dry_run:  # the tiny model unless told: a context of 1,024
        a.rounds, a.warmup, a.kv_bytes, a.max_model_len = 1, False, 64 << 20, 1024
    a.model = a.model or ("tiny" if a.dry_run else "default")
    ckpt = harness.model_dir(a.model)  # converts an embedded model once: the warm starts follow
    model = str(ckpt) if a.model == "tiny" else a.model  # steerserve serves names as given
    if a.dtype == "auto":
        from steerserve.engine.cpu import serve_dtype

        a.dtype = serve_dtype("auto", False)
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    logs = a.out.parent / f"{a.out.stem}-logs"  # kept: a start that fails says why there
    logs.mkdir(parents=True, exist_ok=True)
    for arm in ARMS if a.warmup else ():  # not counted: then the page cache holds the checkpoint
        print(
            json.dumps({"warm-up": arm, **one_start(arm, model, ckpt, a.dtype, a, logs)}),
            flush=True,
        )
    for r in range(a.rounds):
        for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
            runs[arm].append(one_start(arm, model, ckpt, a.dtype, a, logs))
            print(json.dumps({"round": r, "arm": arm, **runs[arm][-1]}), flush=True)
    keys = ("ready", *ROLES, "total", *SPLIT)
    series = {arm: {"ready": [x["ready_s"] for x in runs[arm]]} for arm in ARMS}
    for key in keys[1:]:
        for arm in ARMS:
            series[arm][key] = [
                x["front_end"][SPLIT[key]] if key in SPLIT else x["rss_mib"][key] for x in runs[arm]
            ]
    ratios = {key: _ratio(series, key) for key in keys}
    summary = {
        "model": ckpt.name,
        "dtype": a.dtype,
        "device": harness.cpu_info(),
        "rounds": a.rounds,
        "runs": runs,
        "ratios": ratios,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(summary, indent=2))
    print("\n| | stock (median) | steerserve (median) | steerserve/stock (median, 95 % CI) |")
    print("|---|---|---|---|")
    for key in keys:
        unit = "s" if key == "ready" else "MiB"
        med = {arm: statistics.median(series[arm][key]) for arm in ARMS}
        v = ratios[key]
        cell = f"{v['median']:.3f} [{v['ci95'][0]:.3f}, {v['ci95'][1]:.3f}]" if v else "-"
        print(f"| {key} {unit} | {med['stock']:.1f} | {med['steerserve']:.1f} | {cell} |")
    print(f"\nwritten: {a.out}")


if __name__ == "__main__":
    main()
