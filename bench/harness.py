"""What every benchmark shares: servers started as users start them, free ports, the CPU's facts,
the models, and paired ratios with intervals; one home, so no script keeps a private copy.

A script in ``bench/`` imports it as ``harness`` (its folder is first on ``sys.path``).
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: The CPU flags that decide vLLM's CPU kernels.
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni")
PROMPTS = (
    "The capital of France is", "フランスの首都は", "La capitale de l'Italie est",
    "독일의 수도는", "El idioma oficial de Brasil es", "中国的首都是",
    "The currency of Japan is the", "Die Hauptstadt von Spanien ist",
)  # fmt: skip


def cpu_info() -> str:
    """The CPU model and the flags that decide vLLM's CPU kernels."""
    from steerserve.engine.cpu import cpu_flags

    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if "model name" in ln), "")
    flags = cpu_flags(text)
    return f"{name or platform.processor()}; flags: {' '.join(f for f in FLAGS if f in flags)}"


def machine() -> str:
    """Architecture, cores, date and load: the line every result starts with."""
    load = os.getloadavg()
    return (
        f"{platform.machine()}, {os.cpu_count()} CPUs, {cpu_info()}; {time.strftime('%Y-%m-%d')}; "
        f"load average (1/5 min) {load[0]:.1f}/{load[1]:.1f}"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompts(n: int) -> list[str]:
    """``n`` distinct short fact prompts in several languages."""
    return [f"{PROMPTS[i % len(PROMPTS)]} ({i})" for i in range(n)]


def model_dir(name: str) -> Path:
    """``tiny``: a random 28-block Llama (hidden 256, byte vocabulary) built once: per-step costs
    of a deep model at toy compute. Else an embedded model name or a checkpoint folder."""
    from steerserve.models import cache_dir, resolve_model
    from steerserve.models.tiny import build_tiny_model

    if name == "tiny":
        return build_tiny_model(
            cache_dir() / "bench" / "tiny-llama-28x256", num_layers=28, hidden=256
        )
    return Path(resolve_model(name))


def tiny_with_vectors(tmp: Path) -> tuple[Path, Path]:
    """A tiny 4-block Llama and a two-intervention artifact for it (offline, seconds)."""
    import torch

    from steerserve.artifacts import Intervention, Manifest, binding_for_model, save_artifact
    from steerserve.models.tiny import build_tiny_model

    model = build_tiny_model(tmp / "tiny-llama", "llama")
    ivs = [Intervention(name="recall", tensor="recall", layer=1, scale=4.0),
           Intervention(name="translation", tensor="translation", layer=2, scale=2.0)]  # fmt: skip
    manifest = Manifest(
        name="tiny", version="v1", model=binding_for_model(model), interventions=ivs
    )
    g = torch.Generator().manual_seed(0)
    tensors = {k: torch.randn(64, generator=g) for k in ("recall", "translation")}
    save_artifact(tmp / "vectors" / "tiny" / "v1", manifest, tensors)
    return model, tmp / "vectors"


# --- servers ----------------------------------------------------------------------------------


def role(p: Any, top_pid: int) -> str:
    """A process's part in a server's tree, read from its title (vLLM sets them)."""
    if p.pid == top_pid:
        return "front end"
    try:
        title = " ".join([p.name(), *p.cmdline()])
    except Exception:  # noqa: BLE001 (gone meanwhile)
        return "worker"
    return "EngineCore" if "EngineCore" in title else "worker"


class Server:
    """A server subprocess in its own session (its engine processes go with it on stop)."""

    def __init__(
        self, name: str, cmd: list[str], env: dict[str, str] | None, log: Path, ready: str
    ) -> None:
        self.name, self.log, self.ready = name, log, ready
        self.port = int(cmd[cmd.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        log.parent.mkdir(parents=True, exist_ok=True)
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
        )

    def tree(self) -> list[Any]:
        import psutil

        top = psutil.Process(self.proc.pid)
        return [top, *top.children(recursive=True)]

    def wait_ready(self, timeout: float = 900) -> float:
        """Seconds from the start until ``ready`` answers 200; an exit or a timeout raises."""
        import httpx

        end = time.time() + timeout
        while time.time() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}; see {self.log}")
            try:
                if httpx.get(self.url + self.ready, timeout=2).status_code == 200:
                    return time.perf_counter() - self.t0
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready; see {self.log}")

    def rss_mib(self) -> dict[str, float]:
        """MiB resident by role (front end, EngineCore, worker), summed over its processes."""
        return self._by_role(lambda p: p.memory_info().rss / 2**20)

    def cpu_seconds(self) -> float:
        """CPU time (user + system) of the server's processes so far."""
        return sum(self.cpu_by_role().values())

    def cpu_by_role(self) -> dict[str, float]:
        """CPU seconds (user + system) so far by role (front end, EngineCore, worker): which
        process a cost lands in, where two cores are shared by all of them."""
        return self._by_role(lambda p: sum(p.cpu_times()[:2]))

    def _by_role(self, read: Callable[[Any], float]) -> dict[str, float]:
        """``read(process)`` summed by role over the server's processes."""
        out = dict.fromkeys(("front end", "EngineCore", "worker"), 0.0)
        for p in self.tree():
            try:
                out[role(p, self.proc.pid)] += read(p)
            except Exception:  # noqa: BLE001,S112 (a process that ended meanwhile holds nothing)
                continue
        return out

    def stop(self, timeout: float = 60) -> int:
        """Its exit status after SIGTERM, as a supervisor stops it (its session SIGKILLed after
        ``timeout`` seconds)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        return self.proc.returncode


def engine_flags(
    dtype: str, max_model_len: int, max_num_seqs: int, kv_bytes: int, compiled: bool = False
) -> list[str]:
    """The engine flags stock vLLM and ``steerserve serve`` both take, served as ``bench``."""
    flags = ["--dtype", dtype, "--max-model-len", str(max_model_len)]
    flags += ["--max-num-seqs", str(max_num_seqs), "--kv-cache-memory-bytes", str(kv_bytes)]
    return [*flags, "--served-model-name", "bench", "--compile" if compiled else "--enforce-eager"]


def serve(
    kind: str,
    model: str | Path,
    flags: Sequence[str],
    logs: Path,
    env: dict[str, str] | None = None,
    wait: bool = True,
    bind: bool = True,
) -> Server:
    """``steerserve serve MODEL FLAGS`` or, for ``kind`` "stock", vLLM's own OpenAI server with
    plugins off, on a free port, in vLLM's multi-process mode with every core bound unless not
    ``bind`` (as ``steerserve serve`` binds a CPU worker): the process tree a user gets."""
    from steerserve.engine.cpu import bind_all_cores

    env = dict(os.environ if env is None else env)
    if bind:
        bind_all_cores(env, False, 1)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    port = ["--port", str(free_port())]
    if kind == "stock":
        env["VLLM_PLUGINS"] = "none"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
        cmd += [*flags, *port, "--seed", "0"]
        if "--compile" in cmd:  # stock vLLM compiles unless told --enforce-eager
            cmd.remove("--compile")
    else:
        cmd = [sys.executable, "-m", "steerserve", "serve", str(model), *flags, *port]
    ready = "/health" if kind == "stock" else "/ready"
    srv = Server(kind, cmd, env, logs / f"{kind}-{port[1]}.log", ready)
    if wait:
        srv.wait_ready()
    return srv


# --- ratios -----------------------------------------------------------------------------------


def paired(num: Sequence[float], den: Sequence[float]) -> list[float]:
    """Per-round ratios: both arms measured in the same round, under the same load."""
    return [x / y for x, y in zip(num, den, strict=True)]


def median_ci(xs: Sequence[float], n: int = 4000) -> tuple[float, float]:
    """95 % bootstrap interval of the median, rounds resampled (seeded): how far round-to-round
    noise lets it move, to read against a target's margin."""
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def ratio_summary(num: Sequence[float], den: Sequence[float]) -> dict[str, Any]:
    """The paired ratios' median, its bootstrap interval and every round's ratio."""
    rs = paired(num, den)
    return {"median": statistics.median(rs), "ci95": list(median_ci(rs)), "per_round": rs}


def geometric_ci(ratios: Sequence[float]) -> dict[str, float]:
    """The geometric mean of per-round ratios with its 95 % t-interval (on the logs: 2 and 1/2
    average to 1), and the median."""
    from scipy import stats

    logs = [math.log(r) for r in ratios]
    m, half = statistics.fmean(logs), math.nan
    if len(logs) > 1:
        half = stats.t.ppf(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return {"mean": math.exp(m), "lo": math.exp(m - half), "hi": math.exp(m + half),
            "median": statistics.median(ratios)}  # fmt: skip


def fmt(r: dict[str, Any]) -> str:
    """``median [lo, hi]`` of a :func:`ratio_summary`."""
    return f"{r['median']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]"


# --- docs/benchmarks.md -----------------------------------------------------------------------


def write_docs(
    section: str, text: str, sub: str | None = None, intro: str = "", path: Path | None = None
) -> None:
    """Put ``text`` under ``## section`` (or its ``### sub``) of docs/benchmarks.md, keeping the
    section's other subsections and every other section."""
    path = path or ROOT / "docs" / "benchmarks.md"
    doc = path.read_text() if path.exists() else "# Benchmarks\n"
    head = f"## {section}\n"
    if head not in doc:
        doc = doc.rstrip("\n") + f"\n\n{head}\n{intro}\n"
    start = doc.index(head)
    end = doc.find("\n## ", start + 1)
    end = len(doc) if end < 0 else end + 1
    if sub is None:
        new = f"{head}\n{intro + chr(10) * 2 if intro else ''}{text.strip()}\n"
    else:
        parts = re.split(r"(?m)^(?=### )", doc[start:end])  # [intro, "### a ...", ...]
        block = f"### {sub}\n\n{text.strip()}\n"
        at = [i for i, p in enumerate(parts) if p.startswith(f"### {sub}\n")]
        if at:
            parts[at[0]] = block
        else:
            parts.append(block)
        new = "\n".join(p.strip("\n") + "\n" for p in parts)
    rest = doc[end:]
    path.write_text(doc[:start] + new + ("\n" + rest if rest else ""))


def serve_arm(kind: str, model: str | Path, a: Any, logs: Path) -> Server:
    """One side of a stock-vs-steerserve comparison: the same engine settings from ``a``
    (``dtype``, ``max_model_len``, ``max_num_seqs``, ``kv_cache_bytes``, ``compile``); eager
    unless ``a.compile``; steerserve with ``--steering off`` and no vectors unless ``a.vectors``
    (its shipped ones)."""
    flags = engine_flags(a.dtype, a.max_model_len, a.max_num_seqs, a.kv_cache_bytes,
                         getattr(a, "compile", False))  # fmt: skip
    if kind != "stock":
        flags += ["--steering", "off", "--log-level", "warning"]
        if not getattr(a, "vectors", False):
            (logs / "no-vectors").mkdir(parents=True, exist_ok=True)
            flags += ["--vectors-dir", str(logs / "no-vectors")]
    return serve("stock" if kind == "stock" else "steerserve", model, flags, logs)


# --- engines, and arms in child processes -------------------------------------------------------


def burst_tps(eng: Any, prompts: list[str], steering: Any, sp: Any) -> float:
    """Tokens/s of one batch of ``prompts`` through a ``SteerEngine``, submitted at once."""
    t = time.perf_counter()
    outs = eng.generate(prompts, sp, steering=steering)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)


def bind_env(bind: str) -> dict[str, str]:
    """``auto``: vLLM's CPU binding (core 0 computes, core 1 left to the front end); ``both``:
    the worker's OpenMP threads on every core, as ``steerserve serve`` binds them."""
    from steerserve.engine.cpu import bind_all_cores

    if bind not in ("auto", "both"):
        raise ValueError(f"bind must be auto or both, not {bind!r}")
    env: dict[str, str] = {}
    if bind == "both":
        bind_all_cores(env, False, 1)
    return env


def rss_gib() -> float:
    """Resident memory of this process and its children (an engine's core and worker)."""
    import psutil

    me = psutil.Process()
    return sum(p.memory_info().rss for p in [me, *me.children(recursive=True)]
               if p.is_running()) / 2**30  # fmt: skip


def run_child(cmd: list[str], env: dict[str, str], spec: str) -> tuple[dict, str]:
    """An arm's child process (vLLM reads its CPU variables once a process): its last ``RESULT
    {json}`` line, and its stdout + stderr."""
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"{spec} failed ({p.returncode}):\n{p.stdout[-2000:]}{p.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT ") :]), p.stdout + p.stderr
