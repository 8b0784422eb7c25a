"""Load test: concurrent clients against a real `steerserve serve` on loopback, bounded in time.

64 clients (by default) for 5 minutes mix chat and completions, collected and streamed, steered
and unsteered (``auto``, on, multipliers, entries), greedy and seeded sampling, A/B calls and
clients that hang up (mid-stream, or before a collected answer). Every answer must equal the one
the same request got alone before the load (fp32, so batching does not change numerics); the run
counts 5xx, engine deaths (/health polled every second, the EngineCore pid checked) and hang-ups
the server did not count as 499. The RSS of every process (server, EngineCore, worker) is taken
after the solo runs and again once ``--memory-at`` requests are done.

    .venv/bin/python bench/load.py                       # 64 clients x 300 s, tiny model, fp32
    .venv/bin/python bench/load.py --write-docs          # also records it in docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import harness
import httpx
import psutil

MODEL = "tiny"
EN = "What is the capital city of France? Please answer briefly."
FR = "Quelle est la capitale de la France ? Réponds brièvement, s'il te plaît."
JA = "日本の首都はどこですか"
SEEDED = {"temperature": 0.8, "seed": 7}
STEERINGS: list[Any] = [
    False,
    True,
    "auto",
    {"interventions": {"recall": 0.5}},
    {"entries": [{"vector": "tiny/v1/translation", "layer": 0, "scale": 3.0}]},
]


@dataclass(frozen=True)
class Item:
    """One kind of request; ``drop`` clients hang up (after the first chunk of a stream, or a
    random moment before a collected answer)."""

    name: str
    path: str
    body: dict[str, Any]
    drop: bool = False


def catalogue() -> list[Item]:
    """The request kinds the clients draw from (each has one right answer, found alone)."""
    items: list[Item] = []
    for i, steering in enumerate(STEERINGS):
        prompt = (EN, FR, JA)[i % 3]
        chat = {"model": MODEL, "messages": [{"role": "user", "content": prompt}]}
        chat |= {"max_tokens": 12, "temperature": 0, "steering": steering}
        seeded = chat | {"temperature": 1.0, "seed": 100 + i, "n": 2}
        comp = {"model": MODEL, "prompt": [EN, (FR, JA)[i % 2]], "max_tokens": 10}
        comp |= {"temperature": 0, "steering": steering, "logprobs": 2}
        items += [
            Item(f"chat greedy {i}", "/v1/chat/completions", chat),
            Item(f"chat seeded n=2 {i}", "/v1/chat/completions", seeded),
            Item(f"chat stream {i}", "/v1/chat/completions", seeded | {"stream": True}),
            Item(f"completions batch {i}", "/v1/completions", comp),
            Item(f"completions stream {i}", "/v1/completions", comp | {"stream": True}),
            Item(f"completions seeded {i}", "/v1/completions", comp | SEEDED),
        ]
        if steering is not False:
            ab = chat | {"temperature": 0.9, "seed": 200 + i}
            items.append(Item(f"ab {i}", "/v1/chat/completions/ab", ab))
    long = {"model": MODEL, "max_tokens": 300, "ignore_eos": True}
    stream = long | {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    items.append(Item("drop mid-stream", "/v1/chat/completions", stream, drop=True))
    items.append(Item("drop collected", "/v1/completions", long | {"prompt": "x"}, drop=True))
    return items


def _answer(body: Any) -> Any:
    """What must not change between a solo run and a run under load: texts, finish reasons,
    sampled tokens (logprob values aside), the steering echo."""
    if "unsteered" in body:
        return [_answer(body["unsteered"]), _answer(body["steered"]), body["identical"]]
    out = []
    for c in sorted(body["choices"], key=lambda c: c["index"]):
        text = c["message"]["content"] if "message" in c else c["text"]
        lp = c.get("logprobs") or {}
        out.append((c["index"], text, c["finish_reason"], lp.get("tokens")))
    return [out, body.get("steering")]


async def _stream(r: httpx.Response, drop: bool) -> Any:
    """A stream's choices folded into one answer-like body (or None after hanging up)."""
    texts: dict[int, str] = {}
    finish: dict[int, Any] = {}
    steering = None
    async for line in r.aiter_lines():
        if not line.startswith("data: {"):
            continue
        if drop:
            return None
        ev = json.loads(line[6:])
        steering = steering or ev.get("steering")
        for c in ev["choices"]:
            i = c["index"]
            texts[i] = texts.get(i, "") + (c.get("delta", {}).get("content") or c.get("text", ""))
            finish[i] = c.get("finish_reason") or finish.get(i)
    choices = [{"index": i, "text": t, "finish_reason": finish[i]} for i, t in texts.items()]
    return {"choices": choices, "steering": steering}


async def call(c: httpx.AsyncClient, item: Item, rnd: random.Random) -> tuple[int, Any]:
    """(status, comparable answer); status 0 for a client that hung up on purpose. A client
    that hangs up does it on a connection of its own, closed with it (cancelling a request on a
    pooled connection shared with other requests is not what a client going away looks like)."""
    if item.drop:
        async with httpx.AsyncClient(base_url=c.base_url, timeout=300, headers=c.headers) as own:
            return await _call(own, item, rnd)
    return await _call(c, item, rnd)


async def _call(c: httpx.AsyncClient, item: Item, rnd: random.Random) -> tuple[int, Any]:
    if item.body.get("stream"):
        async with c.stream("POST", item.path, json=item.body) as r:
            if r.status_code != 200:
                await r.aread()
                return r.status_code, r.text
            got = await _stream(r, item.drop)
            return (0, None) if item.drop else (200, _answer(got))
    if item.drop:
        try:
            await asyncio.wait_for(c.post(item.path, json=item.body), rnd.uniform(0.05, 0.5))
        except TimeoutError:
            return 0, None
        return 200, None  # answered before the client gave up: not a hang-up
    r = await c.post(item.path, json=item.body)
    return r.status_code, _answer(r.json()) if r.status_code == 200 else r.text


@dataclass
class Tally:
    statuses: Counter = field(default_factory=Counter)
    mismatches: list[str] = field(default_factory=list)
    hangups: int = 0
    done: int = 0
    health_failures: int = 0
    errors: Counter = field(default_factory=Counter)
    drops: Counter = field(default_factory=Counter)  # hang-ups by path
    rss_trace: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    rss_at_mark: dict[str, float] = field(default_factory=dict)
    mark: int = 0  # requests done when rss_at_mark was taken


async def load(
    url: str, items: list[Item], solo: dict[str, Any], args: Any, srv: harness.Server
) -> Tally:
    """``args.clients`` clients until ``args.duration`` seconds have passed; RSS once
    ``args.memory_at`` requests are done."""
    tally = Tally()
    deadline = time.monotonic() + args.duration
    # Clients drop idle connections after --keepalive-expiry (2 s), well before the server's
    # keep-alive (--keep-alive-seconds, 75 s by default): a client reusing a connection the server
    # is closing gets a ReadError (with uvicorn's 5 s and a busy machine, hundreds of them).
    keep = 2 if args.keepalive_expiry > 0 else 0  # 0: a new connection for every request
    limits = httpx.Limits(
        max_connections=4, max_keepalive_connections=keep, keepalive_expiry=args.keepalive_expiry
    )

    async def client(k: int, c: httpx.AsyncClient) -> None:
        rnd = random.Random(k)
        while time.monotonic() < deadline and tally.done < args.max_requests:
            item = rnd.choice(items)
            try:
                status, got = await call(c, item, rnd)
            except httpx.HTTPError as e:  # the server closed on us: counted, never expected
                tally.errors[f"{item.name}: {type(e).__name__}"] += 1
                continue
            tally.done += 1
            if tally.done % args.rss_every == 0:
                tally.rss_trace.append((tally.done, srv.rss_mib()))
            if status == 0:
                tally.hangups += 1
                tally.drops[item.path] += 1
            else:
                tally.statuses[status] += 1
                if status == 200 and got is not None and got != solo[item.name]:
                    tally.mismatches.append(item.name)
            if tally.done == args.memory_at:
                tally.rss_at_mark, tally.mark = srv.rss_mib(), tally.done

    async def health(c: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline and tally.done < args.max_requests:
            try:
                if (await c.get(f"{url}/health", timeout=10)).status_code != 200:
                    tally.health_failures += 1
            except httpx.HTTPError:
                tally.health_failures += 1
            await asyncio.sleep(1)

    headers = {"content-type": "application/json"}

    def session() -> httpx.AsyncClient:  # each client its own connections, as separate clients
        return httpx.AsyncClient(base_url=url, timeout=300, limits=limits, headers=headers)

    async def own(k: int) -> None:
        async with session() as c:
            await client(k, c)

    async with session() as h:
        await asyncio.gather(health(h), *(own(k) for k in range(args.clients)))
    return tally


async def solo_answers(url: str, items: list[Item]) -> dict[str, Any]:
    """Every item's answer, each request alone (greedy or seeded: one right answer)."""
    out = {}
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        for item in items:
            if item.drop:
                continue
            status, got = await call(c, item, random.Random(0))
            assert status == 200, (item.name, got)
            out[item.name] = got
    return out


def serve(model: Path, vectors: Path, logs: Path) -> harness.Server:
    """``steerserve serve`` on loopback, float32 (so batching does not change numerics)."""
    flags = ["--vectors-dir", str(vectors), "--host", "127.0.0.1", "--dtype", "float32",
             "--max-model-len", "512", "--kv-cache-memory-bytes", str(128 << 20),
             "--served-model-name", MODEL, "--log-level", "warning"]  # fmt: skip
    srv = harness.serve("steerserve", model, flags, logs, wait=False)
    srv.wait_ready(600)
    return srv


def settle(url: str, timeout: float = 60) -> float:
    """Requests still in flight (``steerserve_queue_depth``) once the load has stopped: every
    hang-up must have aborted its engine request, so this falls to 0 within seconds."""
    deadline = time.monotonic() + timeout
    while True:
        depth = next(
            float(line.split()[1])
            for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
            if line.startswith("steerserve_queue_depth ")
        )
        if depth == 0 or time.monotonic() > deadline:
            return depth
        time.sleep(0.5)


def metrics(url: str) -> dict[str, float]:
    """steerserve_requests_total by status (all endpoints) and by ``endpoint status``."""
    out: Counter = Counter()
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        m = re.match(r"^steerserve_requests_total\{(.*)\} (\S+)$", line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            out[labels["status"]] += float(m.group(2))
            out[f"{labels['endpoint']} {labels['status']}"] += float(m.group(2))
    return dict(out)


def report(args: Any, t: Tally, rss0: dict, rss1: dict, meta: dict[str, Any]) -> str:
    rows = "\n".join(
        f"| {k} | {rss0[k]:.0f} | {rss1.get(k, 0):.0f} | {rss1.get(k, 0) - rss0[k]:+.0f} |"
        for k in rss0
    )
    fives = sum(n for s, n in t.statuses.items() if s >= 500)
    by = meta["counted_499_by_endpoint"]
    drops = (
        f"Hang-ups by kind: mid-stream (chat) {t.drops['/v1/chat/completions']}, counted 499 "
        f"{by['chat']:.0f}; before a collected answer (completions) {t.drops['/v1/completions']}, "
        f"counted 499 {by['completions']:.0f} (a client that gives up after the server sent the "
        "answer is a 200). Client errors: "
        + (", ".join(f"{k} x{n}" for k, n in t.errors.items()) or "none")
        + ".\n\n"
    )
    names = list(rss0)
    trace = "".join(
        f"| {done} | " + " | ".join(f"{rss.get(k, 0):.0f}" for k in names) + " |\n"
        for done, rss in t.rss_trace
    )
    trace = (
        f"RSS (MiB) every {args.rss_every} requests:\n\n| requests | {' | '.join(names)} |\n"
        f"|---|{'---|' * len(names)}\n{trace}\n"
        if trace
        else ""
    )
    return (
        f"`bench/load.py --clients {args.clients} --duration {args.duration:.0f} "
        f"--max-requests {args.max_requests}`: model "
        f"`steerserve.models.tiny` Llama (4 blocks, hidden 64, byte-level vocabulary, random weights), "
        f"float32, `steerserve serve` in vLLM's multi-process mode on 127.0.0.1; "
        f"{meta['machine']}, {meta['date']}, load average {meta['load0']:.1f} at start, "
        f"{meta['load1']:.1f} at end; {meta['wall']:.0f} s of load.\n\n"
        f"| requests | 200 | 4xx | 5xx | hang-ups | hang-ups counted 499 by the server | "
        f"answers unlike their solo run | /health failures | engine deaths | client errors |\n"
        f"|---|---|---|---|---|---|---|---|---|---|\n"
        f"| {t.done} | {t.statuses[200]} "
        f"| {sum(n for s, n in t.statuses.items() if 400 <= s < 500)} | {fives} | {t.hangups} "
        f"| {meta['counted_499']:.0f} | {len(t.mismatches)} | {t.health_failures} "
        f"| {meta['deaths']} | {sum(t.errors.values())} |\n\n{drops}"
        f"Requests in flight once the clients stopped (steerserve_queue_depth, after up to 60 s): "
        f"{meta['left_in_flight']:.0f}. "
        f"Server exit status after SIGTERM: {meta['exit']}. RSS (MiB) of every process after "
        f"the solo runs and after {meta['mark']} requests:\n\n"
        f"| process | before | after {meta['mark']} | change |\n|---|---|---|---|\n{rows}\n\n"
        f"{trace}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    ap.add_argument("--memory-at", type=int, default=5000, help="RSS again after N requests")
    ap.add_argument("--rss-every", type=int, default=500, help="RSS trace every N requests")
    ap.add_argument(
        "--keepalive-expiry",
        type=float,
        default=2.0,
        help="seconds a client keeps an idle connection (0: a new connection per request)",
    )
    ap.add_argument("--max-requests", type=int, default=100_000, help="stop after N requests")
    ap.add_argument("--json", type=Path, help="write the raw numbers here")
    ap.add_argument("--write-docs", action="store_true", help="record in docs/benchmarks.md")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model, vectors = harness.tiny_with_vectors(Path(tmp))
        srv = serve(model, vectors, Path(tmp))
        try:
            items = catalogue()
            solo = asyncio.run(solo_answers(srv.url, items))
            before = metrics(srv.url)
            rss0 = srv.rss_mib()
            core = next(p.pid for p in srv.tree() if harness.role(p, srv.proc.pid) == "EngineCore")
            load0, t0 = os.getloadavg()[0], time.monotonic()
            tally = asyncio.run(load(srv.url, items, solo, args, srv))
            wall, load1 = time.monotonic() - t0, os.getloadavg()[0]
            left = settle(srv.url)
            after = metrics(srv.url)
            alive = srv.proc.poll() is None and psutil.pid_exists(core)
            if not tally.rss_at_mark:  # fewer requests than --memory-at: RSS at the end
                tally.rss_at_mark, tally.mark = srv.rss_mib(), tally.done
            rss1 = tally.rss_at_mark
        finally:
            code = srv.stop(120)
    meta = {
        "machine": f"{os.cpu_count()} CPUs, {harness.cpu_info()}",
        "date": time.strftime("%Y-%m-%d"),
        "load0": load0,
        "load1": load1,
        "wall": wall,
        "counted_499": after.get("499", 0) - before.get("499", 0),
        "counted_499_by_endpoint": {
            e: after.get(f"{e} 499", 0) - before.get(f"{e} 499", 0) for e in ("chat", "completions")
        },
        "deaths": 0 if alive else 1,
        "exit": code,
        "mark": tally.mark,
        "left_in_flight": left,
    }
    md = report(args, tally, rss0, rss1, meta)
    print(md)
    print("mismatches:", Counter(tally.mismatches).most_common(10), "errors:", dict(tally.errors))
    print(
        "hang-ups by path:", dict(tally.drops), "499 by endpoint:", meta["counted_499_by_endpoint"]
    )
    for done, rss in tally.rss_trace:
        print(f"RSS after {done}:", {k: round(v) for k, v in rss.items()})
    if args.json:
        raw = {**meta, "statuses": dict(tally.statuses), "hangups": tally.hangups}
        raw |= {"mismatches": tally.mismatches, "rss_before": rss0, "rss_after": rss1}
        raw |= {"errors": dict(tally.errors), "drops": dict(tally.drops)}
        raw |= {"rss_trace": tally.rss_trace}
        args.json.write_text(json.dumps(raw, indent=1))
    if args.write_docs:
        harness.write_docs("Load", md, intro=LOAD_INTRO)


LOAD_INTRO = (
    "`bench/load.py` runs concurrent clients against `steerserve serve` on loopback for a fixed "
    "time: chat and completions, collected and streamed, every steering form, greedy and seeded "
    "sampling, A/B calls, and clients that hang up mid-stream or before a collected answer. "
    "Each answer is compared with the one the same request got alone before the load (fp32)."
)


if __name__ == "__main__":
    main()
