"""Waiting for EngineCore to finish a stop it began itself (issue 21, defect 11)."""

from __future__ import annotations

import signal
import time
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

#: Seconds an EngineCore that still catches SIGTERM gets to begin its own teardown (it leaves its
#: busy loop within milliseconds of its last request; the server's drain ends about then too).
SETTLE = 1.0
#: The most a teardown under way is waited for before vLLM's shutdown signals (then kills) it.
TEARDOWN = 30.0


def engine_processes(llm: Any) -> list[BaseProcess]:
    """The EngineCore processes of a multi-process ``AsyncLLM`` (none when run in-process)."""
    resources = getattr(getattr(llm, "engine_core", None), "resources", None)
    manager = getattr(resources, "engine_manager", None)
    return list(getattr(manager, "processes", None) or [])


def catches_sigterm(pid: int) -> bool:
    """Whether process ``pid`` has a SIGTERM handler installed (Linux ``/proc``); True when that
    cannot be read, so that an unknown process is treated as not stopping."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    for line in status.splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    return True


def await_own_stop(
    procs: list[BaseProcess], settle: float = SETTLE, teardown: float = TEARDOWN
) -> list[str]:
    """Block until each process has exited, unless it still catches SIGTERM after ``settle``
    seconds (not stopping) or ``teardown`` seconds have passed; the names of those left."""
    start = time.monotonic()
    left = []
    for proc in procs:
        while proc.is_alive():
            waited = time.monotonic() - start
            pid = proc.pid
            if pid is None or waited > (settle if catches_sigterm(pid) else teardown):
                left.append(proc.name)
                break
            proc.join(0.05)
    return left
