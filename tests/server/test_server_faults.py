"""Faults a supervisor sees (issue 33): the server or its engine killed, or the server alone
stopped, under load. Each ends with honest exit codes and no process of the server left behind:
a server killed with SIGKILL (``kill -9``, the OOM killer) takes its engine with it (before, its
EngineCore and resource tracker were re-parented to PID 1 and ran on, each restart leaking the
old engine's memory). Each test starts a real ``steerserve serve`` (most of its time)."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
from _process import GONE, HEADERS, Serve, serving, under_way

#: Tokens of the requests held in flight: far from their end when the worker is frozen (the
#: tiny Llama's context is 1,024).
TOKENS = 1000


def _live(p: psutil.Process) -> bool:
    """Running and not a zombie (a dead orphan waits for PID 1 to reap it)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _describe(p: psutil.Process) -> str:
    try:
        return f"{p.pid} {p.name()} ppid={p.ppid()} {' '.join(p.cmdline())[:80]}"
    except psutil.Error:
        return str(p.pid)


def _left(srv: Serve, timeout: float = GONE) -> list[str]:
    """The server's processes (EngineCore, worker, resource tracker) still alive once every one
    has gone or ``timeout`` seconds have passed."""
    deadline = time.monotonic() + timeout
    while (alive := [p for p in srv.family if _live(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [_describe(p) for p in alive]


def _family(srv: Serve) -> list[str]:
    """Names of the processes started with the server: the checks below must cover the engine."""
    names = [" ".join(p.cmdline() + [p.name()]) for p in srv.family]
    assert any("EngineCore" in n for n in names), names
    assert any("resource_tracker" in n for n in names), names
    return names


def _unavailable_everywhere(streams: list, collected: list) -> None:
    """Every collected request is a 503 ``service_unavailable`` in OpenAI's format and every
    stream ends with such an error event and ``[DONE]``."""
    for f in collected:
        r, _ = f.result(120)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "service_unavailable", r.text
    for f in streams:
        (status, lines), _ = f.result(120)
        assert status == 200 and lines[-1] == "data: [DONE]", lines[-3:]
        err = json.loads(lines[-2][6:])["error"]
        assert err["type"] == "service_unavailable", lines[-2]


@pytest.mark.parametrize("load", ["idle", "under load"])
def test_server_killed_takes_its_engine_with_it(
    tiny_llama: Path, tmp_path: Path, load: str
) -> None:
    """SIGKILL to the server process alone (the OOM killer, ``kill -9``: no handler runs, nothing
    tells EngineCore), idle or with 8 requests running: within seconds no EngineCore, worker or
    resource tracker of it is left."""
    with serving(tiny_llama, tmp_path) as srv:
        _family(srv)
        assert srv.proc is not None
        if load == "idle":
            os.kill(srv.proc.pid, signal.SIGKILL)
        else:
            c = httpx.Client(base_url=srv.url, headers=HEADERS, timeout=120)
            with c, ThreadPoolExecutor(8) as pool, under_way(srv, c, pool, TOKENS) as flight:
                worker, streams, collected = flight
                os.kill(srv.proc.pid, signal.SIGKILL)
                worker.thaw()  # the engine runs on with its requests, its parent gone
                for f in streams + collected:
                    assert f.exception(120) is not None  # the connection was cut
        assert srv.proc.wait(GONE) == -signal.SIGKILL
        assert _left(srv) == [], srv.tail()


def test_engine_killed_under_load_answers_503_and_exits_1(tiny_llama: Path, tmp_path: Path) -> None:
    """EngineCore killed (OOM killer, crash) with 8 requests running: each is answered in
    OpenAI's format (503, or a stream's error event), the server exits 1 for a supervisor to
    restart it, and no process is left (the worker follows its EngineCore)."""
    with serving(tiny_llama, tmp_path) as srv:
        _family(srv)
        c = httpx.Client(base_url=srv.url, headers=HEADERS, timeout=120)
        with c, ThreadPoolExecutor(8) as pool, under_way(srv, c, pool, TOKENS) as flight:
            worker, streams, collected = flight
            srv.engine_core().kill()
            worker.thaw()
            _unavailable_everywhere(streams, collected)
        assert srv.proc is not None
        assert srv.proc.wait(GONE) == 1, srv.tail()
        assert _left(srv) == [], srv.tail()
        # (vLLM's output handler logs the EngineDeadError with its traceback: the engine did die)


@pytest.mark.parametrize("drain", ["300"])
def test_server_sigterm_alone_drains_with_an_honest_status(
    tiny_llama: Path, tmp_path: Path, drain: str
) -> None:
    """SIGTERM to the server process alone (``kill PID``, a supervisor that signals only its
    child), 8 requests running. With --drain-seconds 1 they cannot finish in time (the worker
    stays frozen until the server has answered them): each is a 503 and the exit status is 1
    (run by test_server_process's d2 deadline case, which signals the server alone). With 300 s
    the engine is let go on: each completes and the exit status is 0. Either way EngineCore,
    which got no signal, is stopped by the server and no process is left."""
    with serving(tiny_llama, tmp_path, STEERSERVE_DRAIN_SECONDS=drain) as srv:
        _family(srv)
        assert srv.proc is not None
        c = httpx.Client(base_url=srv.url, headers=HEADERS, timeout=120)
        with c, ThreadPoolExecutor(8) as pool, under_way(srv, c, pool, TOKENS) as flight:
            worker, streams, collected = flight
            os.kill(srv.proc.pid, signal.SIGTERM)
            if drain == "1":
                for f in streams + collected:
                    f.exception(120)  # dropped at the deadline, the worker still frozen
                worker.thaw()
                _unavailable_everywhere(streams, collected)
            else:
                worker.thaw()
                for f in collected:
                    r, _ = f.result(300)
                    assert r.status_code == 200, r.text
                    assert r.json()["usage"]["completion_tokens"] == TOKENS
                for f in streams:
                    (status, lines), _ = f.result(300)
                    assert status == 200 and lines[-1] == "data: [DONE]", lines[-3:]
                    usage = json.loads(lines[-2][6:])["usage"]
                    assert usage["completion_tokens"] == TOKENS, lines[-2]
        status = srv.proc.wait(GONE)
        log = srv.tail(100_000)
        if drain == "1":
            assert status == 1, log[-3000:]
            assert "8 request(s) dropped" in log, log[-3000:]
        else:
            assert status == 0, log[-3000:]
        assert _left(srv) == [], log[-3000:]
        assert "Traceback" not in log, log[-3000:]
