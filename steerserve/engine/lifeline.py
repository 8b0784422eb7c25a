"""A vLLM child process (EngineCore, its worker) stops when its parent dies, however it died."""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import signal
import threading
import time

logger = logging.getLogger(__name__)

#: Seconds between two looks at the parent's pid.
POLL = 0.5
#: Seconds the process's own teardown on SIGTERM (EngineCore: stop the worker, unlink shared
#: memory) gets before the process exits hard; requests in flight have nobody to answer.
TEARDOWN = 5.0

_installed = False
_watching = False
_forking_pid: int | None = None  # the pid of the process about to fork, read by the child


def install() -> None:
    """Called in every vLLM process (the plugin): children forked from here on, and this process
    if it is itself a multiprocessing child (spawned: it loads the plugin anew), watch their
    parent. Idempotent."""
    global _installed
    if _installed:
        return
    _installed = True
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    parent = multiprocessing.parent_process()
    if parent is not None and parent.pid is not None:
        watch(parent.pid)


def _before_fork() -> None:
    global _forking_pid
    _forking_pid = os.getpid()


def _after_fork_in_child() -> None:
    global _watching
    _watching = False  # the parent's watcher thread did not survive the fork
    if _forking_pid is not None:
        watch(_forking_pid)


def watch(parent: int) -> None:
    """Stop this process once ``parent`` is no longer its parent (it died: the process was
    re-parented). Only one watcher per process."""
    global _watching
    if _watching:
        return
    _watching = True
    threading.Thread(target=_watch, args=(parent,), name="steerserve-lifeline", daemon=True).start()


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL)
    name = multiprocessing.current_process().name
    logger.warning(
        "steerserve: parent process %d died; %s (pid %d) stops", parent, name, os.getpid()
    )
    # The kernel ends the process TEARDOWN seconds from now whatever Python is doing: SIGALRM's
    # default action is to terminate, and it needs no Python thread to wake (an outside probe
    # saw a worker outlive its parent by 30-81 s after logging this, waiting on the sleep below).
    if signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, None):
        signal.alarm(int(math.ceil(TEARDOWN)))
    # vLLM's own teardown where it handles SIGTERM; the default action (exit) where nothing does;
    # ignored in a worker, which stops when EngineCore closes its death pipe or dies.
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(TEARDOWN)
    logger.warning(
        "steerserve: %s (pid %d) still running %.0f s later: exits", name, os.getpid(), TEARDOWN
    )
    os._exit(1)
