"""Keep vLLM's worker processes alive through a SIGINT/SIGTERM sent to the whole process group."""

from __future__ import annotations

import logging
import signal
import threading

logger = logging.getLogger(__name__)

#: ``__qualname__`` prefix of the handler vLLM's ``WorkerProc.worker_main`` installs.
WORKER_HANDLER = "WorkerProc.worker_main."


def ignore_group_signals_in_worker() -> bool:
    """In a vLLM worker process (its handler installed, main thread): ignore SIGINT and SIGTERM.
    Anywhere else (the caller's own process, EngineCore running the model in-process) nothing
    changes. Returns whether the handlers were replaced."""
    if threading.current_thread() is not threading.main_thread():
        return False
    sigs = (signal.SIGINT, signal.SIGTERM)
    handlers = [signal.getsignal(s) for s in sigs]
    if not all(getattr(h, "__qualname__", "").startswith(WORKER_HANDLER) for h in handlers):
        return False
    for s in sigs:
        signal.signal(s, signal.SIG_IGN)
    logger.info("steerserve: worker ignores SIGINT/SIGTERM; EngineCore drains, then stops it")
    return True
