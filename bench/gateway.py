"""Gateway overhead: the same requests through the HTTP server and straight into its AsyncLLM.

Both paths use one engine (the server's), so the ratio is what FastAPI + JSON + HTTP + steering
policy cost on top of vLLM. Requests alternate between the paths so load drift hits both alike.

    .venv/bin/python bench/gateway.py                 # tiny model, prints a markdown table
    .venv/bin/python bench/gateway.py --write-docs    # also records it in docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "The capital of France is",
    "La capitale de la France est",
    "Die Hauptstadt von Deutschland ist",
    "The largest ocean on Earth is",
]


@dataclass
class Run:
    latencies: list[float]
    tokens: int
    wall: float
    batch_p50: list[float] = field(default_factory=list)  # per batch, for paired ratios
    cpu: float = 0.0  # CPU seconds of the API process (server + AsyncLLM front end)

    def p(self, q: float) -> float:
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]

    @property
    def p50(self) -> float:
        return statistics.median(self.latencies)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall


class Bench:
    """A server in a background thread (own event loop) and the means to call either path."""

    def __init__(
        self, model: Path, vectors: Path | None, max_tokens: int, engine: dict | None = None
    ) -> None:
        import uvicorn

        from steerserve.engine.api import EngineConfig
        from steerserve.server import ServerSettings, create_app

        # As `steerserve serve` runs it: dtype auto, vLLM's multi-process executor (the caller
        # may set VLLM_ENABLE_V1_MULTIPROCESSING=0 for a faster start); ``engine`` overrides
        # other EngineConfig fields (bench/chat_model.py: dtype, eager or compiled).
        kw = {"max_model_len": 512, "kv_cache_memory_bytes": 256 << 20} | (engine or {})
        cfg = EngineConfig(model=str(model), **kw)
        settings = ServerSettings(
            engine=cfg, vectors_dir=None if vectors is None else str(vectors), steering="off"
        )
        self.app = create_app(settings)
        self.state = self.app.state.steer
        self.max_tokens = max_tokens
        sock_port = _free_port()
        self.url = f"http://127.0.0.1:{sock_port}"
        self.server = uvicorn.Server(
            uvicorn.Config(self.app, host="127.0.0.1", port=sock_port, log_level="warning")
        )
        try:  # the loop `steerserve serve` runs on (uvicorn picks uvloop when installed)
            import uvloop

            self.loop = uvloop.new_event_loop()
        except ImportError:
            self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_until_complete, args=(self.server.serve(),), daemon=True
        )

    def start(self) -> None:
        import httpx

        self.thread.start()
        for _ in range(1200):
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise TimeoutError("server not ready")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)

    # --- the two paths -----------------------------------------------------------------------

    async def _direct(self, prompt: str, steered: bool) -> int:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        from steerserve.engine.api import make_prompt, with_steering
        from steerserve.server.steering import On

        eng = self.state.backend
        entries = self.state.policy.resolve(On()).entries if steered else None
        prepared = eng.prepare(entries)
        sp = SamplingParams(
            max_tokens=self.max_tokens,
            temperature=0.0,
            ignore_eos=True,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        # Token ids, as the server sends them (vLLM's raw-text path adds a thread-pool hop).
        ids = list(eng.tokenizer.encode(prompt))
        last = None
        async for out in eng.llm.generate(
            make_prompt(ids), with_steering(sp, prepared), uuid.uuid4().hex
        ):
            last = out
        return len(last.outputs[0].token_ids)

    async def direct_async(self, prompt: str, steered: bool) -> tuple[float, int]:
        t0 = time.perf_counter()
        fut = asyncio.run_coroutine_threadsafe(self._direct(prompt, steered), self.loop)
        n = await asyncio.wrap_future(fut)
        return time.perf_counter() - t0, n


class HttpClient:
    """The HTTP load generator in its own process (as real clients are): no GIL shared with the
    server. Commands go over stdin, one JSON line per batch; results come back on stdout."""

    def __init__(self, url: str, model: str, max_tokens: int) -> None:
        import subprocess
        import sys

        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--client", url, model, str(max_tokens)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def batch(self, prompts: list[str], steered: bool) -> list[tuple[float, int]]:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps({"prompts": prompts, "steered": steered}) + "\n")
        self.proc.stdin.flush()
        return [tuple(x) for x in json.loads(self.proc.stdout.readline())]  # type: ignore[misc]

    def close(self) -> None:
        assert self.proc.stdin
        self.proc.stdin.close()
        self.proc.wait(30)


def client_main(url: str, model: str, max_tokens: int) -> None:
    """``--client``: run each batch of requests concurrently, print (latency, tokens) pairs."""
    import sys

    import httpx

    async def one(c: httpx.AsyncClient, prompt: str, steered: bool) -> tuple[float, int]:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        body |= {"ignore_eos": True, "steering": steered}
        t0 = time.perf_counter()
        r = await c.post("/v1/completions", json=body)
        dt = time.perf_counter() - t0
        r.raise_for_status()
        return dt, r.json()["usage"]["completion_tokens"]

    async def serve() -> None:
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as c:
            loop = asyncio.get_running_loop()
            while line := await loop.run_in_executor(None, sys.stdin.readline):
                cmd = json.loads(line)
                res = await asyncio.gather(*(one(c, p, cmd["steered"]) for p in cmd["prompts"]))
                print(json.dumps(res), flush=True)

    asyncio.run(serve())


def measure(
    b: Bench, client: HttpClient, n: int, concurrency: int, steered: bool
) -> dict[str, Run]:
    """``n`` requests per path at ``concurrency``; batches alternate between the paths."""
    runs = {"server": Run([], 0, 0.0), "direct": Run([], 0, 0.0)}

    async def direct_batch(prompts: list[str]) -> list[tuple[float, int]]:
        return await asyncio.gather(*(b.direct_async(p, steered) for p in prompts))

    client.batch(PROMPTS[:2], steered)  # warm both paths
    asyncio.run(direct_batch(PROMPTS[:2]))
    for i, start in enumerate(range(0, n, concurrency)):
        k = min(concurrency, n - start)
        prompts = [PROMPTS[(start + j) % len(PROMPTS)] for j in range(k)]
        for path in ("server", "direct") if i % 2 == 0 else ("direct", "server"):
            t0, c0 = time.perf_counter(), time.process_time()
            if path == "server":
                res = client.batch(prompts, steered)
            else:
                res = asyncio.run(direct_batch(prompts))
            runs[path].wall += time.perf_counter() - t0
            runs[path].cpu += time.process_time() - c0
            runs[path].latencies += [r[0] for r in res]
            runs[path].tokens += sum(r[1] for r in res)
            runs[path].batch_p50.append(statistics.median(r[0] for r in res))
    return runs


def paired_ratio(runs: dict[str, Run]) -> float:
    """Median over batches of server/direct batch-median latency: adjacent batches see the same
    background load, so this survives a noisy machine better than the ratio of overall p50s."""
    s, d = runs["server"].batch_p50, runs["direct"].batch_p50
    return statistics.median(a / b for a, b in zip(s, d, strict=True))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tiny(tmp: Path) -> tuple[Path, Path]:
    """A tiny Llama and a two-intervention artifact for it (offline, seconds)."""
    import torch

    from steerserve.artifacts import Intervention, Manifest, binding_for_model, save_artifact
    from steerserve.models.tiny import build_tiny_model

    model = build_tiny_model(tmp / "tiny-llama", "llama")
    ivs = [
        Intervention(name="recall", tensor="recall", layer=1, scale=4.0),
        Intervention(name="translation", tensor="translation", layer=2, scale=2.0),
    ]
    manifest = Manifest(
        name="tiny", version="v1", model=binding_for_model(model), interventions=ivs
    )
    g = torch.Generator().manual_seed(0)
    save_artifact(
        tmp / "vectors" / "tiny" / "v1",
        manifest,
        {k: torch.randn(64, generator=g) for k in ("recall", "translation")},
    )
    return model, tmp / "vectors"


def table(results: list[tuple[str, int, dict[str, Run]]], max_tokens: int) -> str:
    head = (
        "| workload | concurrency | path | p50 ms | p95 ms | tokens/s | p50 ratio | paired p50 ratio "
        "| tok/s ratio | API CPU ms/req |\n|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for name, conc, runs in results:
        s, d = runs["server"], runs["direct"]
        for path, r in (("direct AsyncLLM", d), ("server (HTTP)", s)):
            ratio = f"{s.p50 / d.p50:.3f}" if r is s else ""
            paired = f"**{paired_ratio(runs):.3f}**" if r is s else ""
            tput = f"{s.tok_s / d.tok_s:.3f}" if r is s else ""
            rows.append(
                f"| {name} | {conc} | {path} | {r.p50 * 1e3:.1f} | {r.p(0.95) * 1e3:.1f} "
                f"| {r.tok_s:.0f} | {ratio} | {paired} | {tput} "
                f"| {r.cpu / len(r.latencies) * 1e3:.2f} |"
            )
    return head + "\n".join(rows) + "\n"


GATEWAY_INTRO = (
    "## Gateway\n\n"
    "What the HTTP layer costs: `bench/gateway.py` sends the same requests through "
    "`steerserve serve`'s app and straight into its `AsyncLLM` (one engine), alternating "
    "batches. Target: p50 ratio <= 1.05. One subsection per model; rerun with `--write-docs`.\n"
)


def write_docs(model: str, meta: str, md: str) -> None:
    """Put this run under ``## Gateway`` / ``### <model>`` in docs/benchmarks.md (other sections
    and other models' runs are kept)."""
    path = ROOT / "docs" / "benchmarks.md"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if "## Gateway" not in text:
        text = text.rstrip("\n") + "\n\n" + GATEWAY_INTRO
    start = text.index("## Gateway")
    end = text.find("\n## ", start + 1)
    end = len(text) if end < 0 else end + 1
    subs = re.split(r"(?m)^(?=### )", text[start:end])  # [intro, "### a ...", "### b ...", ...]
    new = f"### {model}\n\n{meta}\n\n{md.strip()}\n"
    found = [i for i, part in enumerate(subs) if part.startswith(f"### {model}\n")]
    if found:
        subs[found[0]] = new
    else:
        subs.append(new)
    section = "\n".join(part.strip("\n") + "\n" for part in subs)
    rest = text[end:]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text[:start] + section + ("\n" + rest if rest else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="local checkpoint (default: a tiny random Llama)")
    ap.add_argument("--vectors-dir", type=Path, help="artifacts for --model (steered rows)")
    ap.add_argument(
        "--requests", type=int, default=30, help="batches per path and workload (paired)"
    )
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--write-docs", action="store_true", help="record in docs/benchmarks.md")
    ap.add_argument("--client", nargs=3, metavar=("URL", "MODEL", "MAX_TOKENS"), help="internal")
    args = ap.parse_args()
    if args.client:
        client_main(args.client[0], args.client[1], int(args.client[2]))
        return

    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        model, vectors = (args.model, args.vectors_dir)
        if model is None:
            model, vectors = _tiny(Path(tmp))
        b = Bench(model, vectors, args.max_tokens)
        b.start()
        client = HttpClient(b.url, b.state.model_name, args.max_tokens)
        steerable = b.state.policy.default_artifact is not None
        try:
            results = []
            for steered in (False, True) if steerable else (False,):
                arm = "steered" if steered else "unsteered"
                for conc in (1, args.concurrency):
                    n = args.requests if conc == 1 else max(4, args.requests // 3) * conc
                    runs = measure(b, client, n, conc, steered)
                    results.append((f"completions, {arm}", conc, runs))
                    print(f"done: {arm} concurrency {conc}", flush=True)
        finally:
            client.close()
            b.stop()
    md = table(results, args.max_tokens)
    meta = (
        f"`bench/gateway.py`: model `{Path(model).name}` (dtype auto, "
        f"VLLM_ENABLE_V1_MULTIPROCESSING={os.environ.get('VLLM_ENABLE_V1_MULTIPROCESSING', '1')}), "
        f"{args.max_tokens} greedy tokens per "
        f"request (ignore_eos), non-streaming `/v1/completions` vs `AsyncLLM.generate` on the same "
        f"engine; {platform.machine()}, {os.cpu_count()} CPUs, "
        f"{time.strftime('%Y-%m-%d')}, load average {load0:.1f} at start, "
        f"{os.getloadavg()[0]:.1f} at end. Ratio = server / direct (target p50 ratio <= 1.05); "
        "the paired ratio is the median over adjacent batch pairs, robust to background load; "
        "API CPU = CPU time of the process holding the server and AsyncLLM's front end per "
        "request (the engine core runs in its own process; the HTTP client too)."
    )
    print(meta + "\n\n" + md)
    if args.write_docs:
        write_docs(Path(model).name, meta, md)


if __name__ == "__main__":
    main()
