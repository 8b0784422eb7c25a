"""``steerserve serve`` as a subprocess, as users run it (:class:`Serve`, :func:`serving`), and
the requests the drain and fault tests hold in flight with the worker frozen (:func:`under_way`)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psutil
from _server import free_port, make_artifact

KEY = "proc-key"
#: The most seconds a server or one of its processes may take to exit once it should: a bound
#: for a machine busy with other work, not a speed target (each exits within seconds when
#: quiet; psutil.wait_procs and Popen.wait return as soon as they have).
GONE = 180.0
HEADERS = {"Authorization": f"Bearer {KEY}"}


class Serve:
    """A ``steerserve serve`` process in its own process group, its log in a file."""

    def __init__(self, model: Path, tmp: Path) -> None:
        vectors = tmp / "vectors"
        if not vectors.exists():
            make_artifact(vectors, model, "v1")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = os.environ | {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1",  # production mode: EngineCore + worker
            "STEERSERVE_MODEL": str(model),
            "STEERSERVE_VECTORS_DIR": str(vectors),
            "STEERSERVE_PORT": str(self.port),
            "STEERSERVE_DTYPE": "float32",
            "STEERSERVE_MAX_MODEL_LEN": "1024",
            "STEERSERVE_KV_CACHE_MEMORY_BYTES": str(64 << 20),
            "STEERSERVE_API_KEY": KEY,
            "STEERSERVE_STEERING": "on",
            "STEERSERVE_SERVED_MODEL_NAME": "tiny",
            "STEERSERVE_LOG_LEVEL": "warning",
        }
        self.log_path = tmp / f"serve-{self.port}.log"
        self.proc: subprocess.Popen | None = None
        self.family: list[psutil.Process] = []
        self.saw_loading = False

    def start(self) -> None:
        """Start and wait until ready (``saw_loading``: /ready said "loading" before)."""
        log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "steerserve", "serve"],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        saw_loading, deadline = False, time.monotonic() + 300
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.tail()
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    ready = httpx.get(f"{self.url}/ready", timeout=2)
                    if ready.status_code == 200:
                        self.family = [psutil.Process(self.proc.pid)]
                        self.family += self.family[0].children(recursive=True)
                        self.saw_loading = saw_loading
                        return
                    assert ready.status_code == 503 and ready.json()["status"] == "loading"
                    saw_loading = True
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError("not ready in time:\n" + self.tail())

    def engine_core(self) -> psutil.Process:
        [core] = [p for p in self.family if "EngineCore" in " ".join(p.cmdline() + [p.name()])]
        return core

    def survivors(self, timeout: float) -> list[str]:
        """The processes started with the server still alive after ``timeout`` seconds."""
        _, alive = psutil.wait_procs(self.family, timeout=timeout)
        return [f"{p.pid} {p.name()}" for p in alive]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        for p in self.family:
            if p.is_running():
                p.kill()

    def tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]


@contextmanager
def serving(model: Path, tmp: Path, **env: str | None) -> Iterator[Serve]:
    """A ready server; ``env`` changes its variables (None removes one)."""
    srv = Serve(model, tmp)
    for k, v in env.items():
        if v is None:
            srv.env.pop(k, None)
        else:
            srv.env[k] = v
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()


def _stream(c: httpx.Client, max_tokens: int, started: threading.Event) -> tuple[int, list[str]]:
    """A streamed chat answer's status and SSE lines, however it ends; ``started`` is set at its
    first line (or when it ends without one)."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    lines = []
    try:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    started.set()
            return r.status_code, lines
    finally:
        started.set()


def completed(lines: list[str], tokens: int) -> bool:
    """A stream that ended with [DONE] after ``tokens`` completion tokens."""
    if len(lines) < 2 or lines[-1] != "data: [DONE]":
        return False
    usage = json.loads(lines[-2][6:]).get("usage") or {}
    return usage.get("completion_tokens") == tokens


def collect(c: httpx.Client, max_tokens: int) -> httpx.Response:
    body = {"model": "tiny", "prompt": "abc", "max_tokens": max_tokens, "ignore_eos": True}
    return c.post("/v1/completions", json=body)


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def _gauges(c: httpx.Client, *names: str) -> list[float]:
    """The values of steerserve gauges on /metrics (0 when absent)."""
    values = dict.fromkeys(names, 0.0)
    for line in c.get("/metrics", timeout=5).text.splitlines():
        name, _, value = line.partition(" ")
        if name in values:
            values[name] = float(value)
    return list(values.values())


def answers_after_idle(url: str, idle: float) -> bool:
    """Whether a keep-alive connection still answers a second request after ``idle`` seconds."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        for i in range(2):
            if i:
                time.sleep(idle)
            conn.request("GET", "/health")
            resp = conn.getresponse()
            resp.read()
            if resp.status != 200:
                return False
    except (http.client.RemoteDisconnected, ConnectionError):
        return False  # the server closed the idle connection
    finally:
        conn.close()
    return True


def _timed(fn: Any, *args: Any) -> tuple[Any, float]:
    return fn(*args), time.monotonic()


def in_flight(c: httpx.Client, n: int, futures: list[Any]) -> None:
    """Wait for ``n`` requests in flight and handed to the engine (a request counts in the queue
    gauge before the engine has it), polling on ``c`` (a new client per poll would load a TLS
    context 50 times a second). Called with the worker frozen (:func:`under_way`), no request
    can end first; one that did end (refused, say) fails the wait at once, saying so."""
    deadline, most = time.monotonic() + 120, 0.0
    while min(seen := _gauges(c, "steerserve_queue_depth", "steerserve_engine_requests")) < n:
        most = max(most, min(seen))
        ended = [f.result() for f in futures if f.done()]
        assert not ended, f"{len(ended)} request(s) ended before {n} were in flight: {ended[0]}"
        assert time.monotonic() < deadline, f"never {n} requests in flight (at most {most})"
        time.sleep(0.02)


class Worker:
    """The engine's worker processes (EngineCore's children), stopped with SIGSTOP and let go on
    with SIGCONT. While they are stopped the engine takes no step, so no request can end,
    however slow the admission of the others; EngineCore itself runs on, so it receives every
    request and, once it has work, drains all of them on a signal (one that found it idle would
    stop it at once, with requests still in its socket)."""

    def __init__(self, srv: Serve) -> None:
        self.procs = srv.engine_core().children(recursive=True)
        assert self.procs, "no worker process"
        self.stopped = False

    def freeze(self) -> None:
        for p in self.procs:
            p.send_signal(signal.SIGSTOP)
        self.stopped = True

    def thaw(self) -> None:
        if self.stopped:
            self.stopped = False
            for p in self.procs:
                if p.is_running():
                    p.send_signal(signal.SIGCONT)

    def step_until(self, done: Callable[[], bool], what: str, limit: float = 120) -> None:
        """Let the frozen worker run in 10 ms pulses until ``done()``, frozen between pulses
        while the front end forwards what it produced. Let go freely instead, the worker ran on
        for as long as this thread waited to be scheduled: on a loaded machine (the CI suite
        beside a second server) long enough for a 1,000-token request to end before the freeze.
        Pulsed, a descheduled test thread leaves the engine frozen, not running."""
        deadline = time.monotonic() + limit
        while not done():
            assert time.monotonic() < deadline, what
            self.thaw()
            time.sleep(0.01)
            self.freeze()
            time.sleep(0.05)


#: Tokens of the requests the drop tests hold in flight (on :func:`long_llama`): they need not
#: finish, and the longer they are, the more engine steps they are from their end when the
#: worker is frozen again.
LONG = 4000


def submit_eight(c: httpx.Client, pool: ThreadPoolExecutor, tokens: int) -> tuple[list, list, list]:
    """4 streamed and 4 collected requests of ``tokens``: the streams' ``started`` events and
    both lists of futures."""
    started = [threading.Event() for _ in range(4)]
    streams = [pool.submit(_timed, _stream, c, tokens, e) for e in started]
    collected = [pool.submit(_timed, collect, c, tokens) for _ in range(4)]
    return started, streams, collected


def _none_ended(futures: list[Any]) -> None:
    ended = [f.result() for f in futures if f.done()]
    assert not ended, f"a request ended while the worker ran: {ended[0]}"


@contextmanager
def under_way(
    srv: Serve, c: httpx.Client, pool: ThreadPoolExecutor, tokens: int
) -> Iterator[tuple[Worker, list[Any], list[Any]]]:
    """4 streamed and 4 collected requests of ``tokens`` in flight, every stream under way (its
    first token sent), the worker frozen: by construction, not by speed. The worker is frozen
    while they are admitted and handed to the engine (none can end first, so all 8 get there),
    let go in short pulses until every stream has its first token (all 8 are then in the
    engine's batch, not in its input queue, where a signal would have it refuse them), and left
    frozen a few steps later, ``tokens`` - a few steps before any could end, however long this
    thread waits to be scheduled (:meth:`Worker.step_until`). Yields the worker (thawed on leaving), the
    streams' and the collected requests' futures."""
    # A fresh engine asks its worker which tasks it supports at its first request: not frozen.
    assert collect(c, 1).status_code == 200
    worker = Worker(srv)
    worker.freeze()
    try:
        started, streams, collected = submit_eight(c, pool, tokens)
        in_flight(c, 8, streams + collected)
        worker.step_until(lambda: all(e.is_set() for e in started), "a stream never started")
        _none_ended(streams + collected)
        yield worker, streams, collected
    finally:
        worker.thaw()


def refused_soon(url: str) -> bool:
    """Whether the server stops accepting connections within 5 s (it drains after a signal)."""
    for _ in range(50):
        try:
            httpx.get(f"{url}/health", timeout=1)
        except httpx.TransportError:
            return True
        time.sleep(0.1)
    return False
