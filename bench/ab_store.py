"""What the A/B experiment store costs a server (issue 47): requests/s and p50 latency with the
store on vs off, paired and interleaved, ratios with a 95 % interval, in one run (not a test).

Arms, two ``steerserve serve`` processes on the same tiny model and settings, both running the
experiment (``--ab-split 0.5``, every request enrolled by its ``user``):

* ``off``   — no store and no log (the decision is made, then not kept anywhere);
* ``store`` — ``--ab-store URL`` (default: a SQLite file in a temporary folder; pass
  ``--store postgresql://...`` for PostgreSQL).

Both servers run at once; the load goes to one at a time, in the order off/store, store/off,
... so drift hits both alike. Per round and arm: ``--requests`` chat completions of ``--tokens``
tokens from ``--clients`` concurrent clients (each request a new user). Per round the ratios
store/off of requests/s, of p50 and of the server's CPU time per request (its process tree's
user + system time: less moved by other jobs on the machine than the wall clock); the mean ratio
and its 95 % t-interval over rounds. At the end the store's queue must be empty and its count
must equal the store arm's answered requests. Last, in this process, the store's own cost per
record: the time a request spends recording it, and the CPU to write it.

``--model tiny`` (default) serves a random tiny Llama: the per-request cost of the store as
visible as it can be. ``--model gemma-3-270m`` serves the small embedded model with its shipped
vectors, the issue's target (there the model's own time dilutes the store's).

    .venv/bin/python bench/ab_store.py [--model gemma-3-270m] [--rounds 8] [--requests 320]
        [--clients 32] [--tokens 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
import httpx

KEY = "bench-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}


def start(
    arm: str, model: Path | str, vectors: Path | None, store: str | None, logs: Path
) -> harness.Server:
    """One server of the pair: the tiny model (a folder, with its artifact) in float32, or an
    embedded model by name with its shipped vectors and the server's own dtype."""
    flags = ["--max-model-len", "512", "--kv-cache-memory-bytes", str(64 << 20)]
    if vectors is not None:
        flags += ["--dtype", "float32", "--vectors-dir", str(vectors)]
    flags += ["--log-level", "warning", "--api-key", KEY]
    flags += ["--ab-split", "0.5", "--ab-name", "bench", "--served-model-name", "tiny"]
    flags += ["--ab-store", store] if store else []
    return harness.serve(arm, model, flags, logs / arm, wait=False)


async def load(url: str, n: int, clients: int, tokens: int, tag: str) -> dict[str, float]:
    """``n`` chat completions from ``clients`` concurrent clients: requests/s and p50 (ms)."""
    latencies: list[float] = []
    todo = iter(range(n))
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, headers=HEADERS, timeout=300, limits=limits) as c:

        async def client() -> None:
            for i in todo:
                body = {
                    "model": "tiny",
                    "messages": [{"role": "user", "content": f"Quelle est la capitale ({i})"}],
                    "max_tokens": tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "user": f"{tag}-{i}",
                }
                t = time.perf_counter()
                r = await c.post("/v1/chat/completions", json=body)
                latencies.append(time.perf_counter() - t)
                if r.status_code != 200:
                    raise RuntimeError(f"{url}: {r.status_code} {r.text[:300]}")

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        wall = time.perf_counter() - t0
    return {"rps": n / wall, "p50_ms": statistics.median(latencies) * 1e3}


def per_record(store: str, n: int) -> dict[str, float]:
    """The store's own cost, in this process and free of the model's noise: microseconds a
    request spends recording its decision (an append to the queue), and CPU microseconds the
    writer thread spends per record to put ``n`` of them in the store."""
    from steerserve.server.ab.experiment import DecisionLog, Decisions, Experiment
    from steerserve.server.ab.store import open_writer

    d = Decisions(DecisionLog(None), open_writer(store, None))
    exp = Experiment("bench", 0.5)
    recs = []
    for i in range(n):
        a = exp.assign(f"micro-{i}")
        recs.append({"experiment": a.name, "arm": a.arm, "subject_hash": a.subject_hash,
                     "endpoint": "chat", "model": "tiny", "language": "fr", "applied": True,
                     "vectors": ["tiny/v1/recall"], "latency_ms": 12.5, "prompt_tokens": 9,
                     "completion_tokens": 8})  # fmt: skip
    cpu0, t0 = time.process_time(), time.perf_counter()
    for i, rec in enumerate(recs):
        d.record(f"chatcmpl-micro-{i}", rec)
    put = time.perf_counter() - t0
    assert d.store.flush(600)
    cpu = time.process_time() - cpu0
    d.close()
    return {"record_us": put / n * 1e6, "cpu_us_per_record": cpu / n * 1e6, "records": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--requests", type=int, default=320, help="per round and arm")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument(
        "--model",
        default="tiny",
        help="tiny (a random tiny Llama: the store's cost as visible as it gets) or an embedded "
        "model's name, e.g. gemma-3-270m (the issue's small model, with its shipped vectors)",
    )
    ap.add_argument("--store", help="the store URL (default: a SQLite file in a temp folder)")
    ap.add_argument("--micro", type=int, default=20000, help="records for the per-record cost")
    ap.add_argument(
        "--control",
        action="store_true",
        help="an A/A run: the `store` arm's server without a store too (how far apart two "
        "identical servers measure on this machine)",
    )
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-ab-store-") as tmp:
        root = Path(tmp)
        model, vectors = harness.tiny_with_vectors(root) if a.model == "tiny" else (a.model, None)
        store = a.store or f"sqlite:///{root}/ab.db"
        arms = (("off", None), ("store", None if a.control else store))
        procs = {arm: start(arm, model, vectors, s, root) for arm, s in arms}
        try:
            for p in procs.values():
                p.wait_ready()
            rows = run(procs, a)
            if not a.control:
                check(procs["store"], a)
        finally:
            for p in procs.values():
                p.stop()
        micro = per_record(a.store or f"sqlite:///{root}/micro.db", a.micro)
    rps = harness.geometric_ci([r["store"]["rps"] / r["off"]["rps"] for r in rows])
    p50 = harness.geometric_ci([r["store"]["p50_ms"] / r["off"]["p50_ms"] for r in rows])
    cpu = harness.geometric_ci([r["store"]["cpu_ms"] / r["off"]["cpu_ms"] for r in rows])
    out = {
        "model": a.model,
        "cpu": harness.cpu_info(),
        "cores": os.cpu_count(),
        "store": "none (control)" if a.control else store.split("://")[0],
        "settings": vars(a),
        "rounds": rows,
        "rps_ratio": rps,
        "p50_ratio": p50,
        "cpu_per_request_ratio": cpu,
        "load_average": os.getloadavg(),
        "per_record": micro,
    }
    print(json.dumps(out, indent=2))
    for name, r in (("requests/s", rps), ("p50", p50), ("server CPU per request", cpu)):
        print(
            f"store/off {name}: {r['mean']:.3f} (95 % CI {r['lo']:.3f} to {r['hi']:.3f}; "
            f"median {r['median']:.3f})"
        )
    print(
        f"per record: {micro['record_us']:.1f} us on the request path, "
        f"{micro['cpu_us_per_record']:.0f} us of CPU in all (queue + writer + database)"
    )


def run(procs: dict[str, harness.Server], a: argparse.Namespace) -> list[dict[str, Any]]:
    """Warm both, then the rounds, the order alternating. Besides requests/s and p50 (wall
    clock: what a client sees, but as noisy as the machine), the server's CPU milliseconds per
    request: what the store adds to the server's work, far less moved by other jobs."""
    for arm, p in procs.items():
        asyncio.run(load(p.url, a.clients * 2, a.clients, a.tokens, f"warm-{arm}"))
    rows = []
    for i in range(a.rounds):
        order = ("off", "store") if i % 2 == 0 else ("store", "off")
        row = {}
        for arm in order:
            cpu = procs[arm].cpu_seconds()
            row[arm] = asyncio.run(
                load(procs[arm].url, a.requests, a.clients, a.tokens, f"r{i}-{arm}")
            )
            row[arm]["cpu_ms"] = (procs[arm].cpu_seconds() - cpu) / a.requests * 1e3
        rows.append(row)
        print(f"round {i}: {json.dumps(row)}", file=sys.stderr)
    return rows


def check(p: harness.Server, a: argparse.Namespace) -> None:
    """The store arm's records all reached the store: its queue drained, nothing dropped, as
    many decisions written as it answered requests (warm-up included)."""
    while True:
        snap = httpx.get(f"{p.url}/v1/steering/experiments", headers=HEADERS, timeout=60).json()
        if snap["store"]["queued"] == 0:
            break
        time.sleep(0.2)
    st, want = snap["store"], a.clients * 2 + a.rounds * a.requests
    print(
        f"store: {st['written']} written, {st['dropped']} dropped, {want} answered", file=sys.stderr
    )
    if st["dropped"] or st["written"] != want or snap["report"]["requests"] != want:
        raise SystemExit(f"the store does not hold every answer: {st}, {want} answered")


if __name__ == "__main__":
    main()
