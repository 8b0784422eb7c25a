"""The outside probe's heavy cases against a real `steerserve serve` (issue 44, items 3-5).

Starts the server on a model (default: the small embedded one), then, one case at a time:
- a 1-token request sent 1 s after each heavy request (32 x 1,900-word echo+logprobs prompts;
  two concurrent n=32 x 200-token requests): its latency and the heavy requests' statuses;
- ``--schemas`` distinct large JSON schemas (``--schema-props`` required properties with
  patterns), then the engine core's resident memory;
- a regex that hits xgrammar's compile timeout: its status;
- ``kill -9`` of the server with requests running: seconds until each of its processes is gone.
Prints one JSON object (and writes it with ``--out``). Measure on a quiet machine.

    python docs/results/probe/probe.py --model gemma-3-270m --out docs/results/probe/after.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

WORDS = ["word "] * 1900


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model: str, port: int, log: Path, extra: list[str] | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "steerserve", "serve", "--model", model, "--port", str(port)]
    cmd += extra or []
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    while proc.poll() is None:  # ready, or the process ended (a failed start)
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise RuntimeError(f"the server exited:\n{log.read_text()[-3000:]}")


def rss_gb(proc: subprocess.Popen) -> dict[str, float]:
    out = {}
    for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
        try:
            name = " ".join(p.cmdline()[:1]) or p.name()
            out[f"{p.pid}:{name[-40:]}"] = round(p.memory_info().rss / 2**30, 2)
        except psutil.Error:
            pass
    return out


async def behind(c: httpx.AsyncClient, model: str, heavy: list[dict[str, Any]]) -> dict:
    """Send ``heavy`` at once, a 1-token request 1 s later: its seconds and every status."""

    async def post(body: dict) -> tuple[int, float, str]:
        t = time.perf_counter()
        r = await c.post("/v1/completions", json={"model": model, **body})
        return r.status_code, time.perf_counter() - t, r.text[:300] if r.status_code != 200 else ""

    tasks = [asyncio.ensure_future(post(b)) for b in heavy]
    await asyncio.sleep(1)
    status, seconds, _ = await post({"prompt": "Hi", "max_tokens": 1, "temperature": 0})
    rest = await asyncio.gather(*tasks)
    return {
        "probe_status": status,
        "probe_seconds": round(seconds, 2),
        "heavy": [{"status": s, "seconds": round(t, 1), "error": e} for s, t, e in rest],
    }


def schema(i: int, props: int) -> dict:
    p = {
        f"f{i}_{k}": {"type": "string", "pattern": f"^[a-z]{{{k % 7 + 1}}}$"} for k in range(props)
    }
    return {"type": "object", "properties": p, "required": list(p)}


async def main(a: argparse.Namespace) -> dict:
    port = free_port()
    proc = start(a.model, port, Path(a.log))
    out: dict[str, Any] = {"model": a.model, "schema_props": a.schema_props}
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=900) as c:
            model = (await c.get("/v1/models")).json()["data"][0]["id"]
            out["rss_gb_start"] = rss_gb(proc)
            echo = {"prompt": ["".join(WORDS)] * 32, "echo": True, "logprobs": 5, "max_tokens": 0}
            out["echo_logprobs"] = await behind(c, model, [echo])
            n32 = {"prompt": "Once upon a time", "n": 32, "max_tokens": 200, "temperature": 1}
            out["two_n32"] = await behind(c, model, [n32, n32])
            out["rss_gb_after_load"] = rss_gb(proc)
            statuses = []
            for i in range(a.schemas):
                body = {
                    "model": model,
                    "prompt": "JSON:",
                    "max_tokens": 8,
                    "structured_outputs": {"json": schema(i, a.schema_props)},
                }
                t = time.perf_counter()
                r = await c.post("/v1/completions", json=body)
                statuses.append([r.status_code, round(time.perf_counter() - t, 1), len(r.content)])
            out["schemas"] = {
                "bytes": len(json.dumps(schema(0, a.schema_props))),
                "status_seconds_bytes": statuses,
            }
            out["rss_gb_after_schemas"] = rss_gb(proc)
            regex = {"regex": "([\\s\\S]{0,999}){999}"}
            r = await c.post(
                "/v1/completions",
                json={"model": model, "prompt": "x", "max_tokens": 5, "structured_outputs": regex},
            )
            out["regex_timeout"] = {"status": r.status_code, "body": r.text[:300]}
            out["alive"] = (await c.get("/ready")).status_code == 200
            out["kill_9"] = await killed(c, model, proc)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(120)
    return out


async def killed(c: httpx.AsyncClient, model: str, proc: subprocess.Popen) -> dict[str, float]:
    """``kill -9`` of the server with 4 long requests running: seconds until each of its
    processes (EngineCore, worker, resource tracker) is gone."""
    family = psutil.Process(proc.pid).children(recursive=True)
    names = {p.pid: _name(p) for p in family}
    body = {"model": model, "prompt": "Once", "max_tokens": 1000, "ignore_eos": True}
    tasks = [asyncio.ensure_future(c.post("/v1/completions", json=body)) for _ in range(4)]
    await asyncio.sleep(3)
    os.kill(proc.pid, signal.SIGKILL)
    t0, gone = time.monotonic(), {}
    while len(gone) < len(family) and time.monotonic() - t0 < 300:
        for p in family:
            if p.pid not in gone and not _live(p):
                gone[p.pid] = round(time.monotonic() - t0, 1)
        await asyncio.sleep(0.1)
    await asyncio.gather(*tasks, return_exceptions=True)
    return {f"{p.pid}:{names[p.pid]}": gone.get(p.pid, -1.0) for p in family}


def _live(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _name(p: psutil.Process) -> str:
    try:
        return p.name()[-30:]
    except psutil.Error:
        return "?"


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--schema-props", type=int, default=5000)
    ap.add_argument("--schemas", type=int, default=8, help="distinct schemas sent, one at a time")
    ap.add_argument("--log", default=os.devnull)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result = asyncio.run(main(args))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
