"""The server as a process (``steerserve serve``): uvicorn, signals and the exit status.

The first SIGINT or SIGTERM drains: new connections are refused and requests in flight finish
(EngineCore, which gets the same signal when the whole process group is signalled, drains too).
A second signal stops at once. The exit status is 1 when the engine failed to load or died, so a
supervisor restarts the process, and 0 after a drain.
"""

from __future__ import annotations

import signal
from typing import Any

import uvicorn

from steerserve.server.app import create_app
from steerserve.server.state import ServerSettings, ServerState


class _Server(uvicorn.Server):
    """uvicorn, told that a signal means stopping (not a dead engine), and forced by a second
    signal of either kind (uvicorn alone forces only on a second SIGINT)."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.state.stopping = True
        if self.should_exit:
            self.force_exit = True
        super().handle_exit(sig, frame)


def serve(settings: ServerSettings, port: int, log_level: str = "info") -> int:
    """Serve until stopped; the process's exit status."""
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=port,
        log_level=log_level.lower(),
        timeout_graceful_shutdown=settings.drain_seconds,
        timeout_keep_alive=settings.keep_alive_seconds,
    )
    server = _Server(config, app.state.steer)
    # uvicorn re-raises a signal it drained on under the handler found at start: a no-op here,
    # so that a drained server exits with its own status instead of dying by the signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    return 1 if app.state.steer.failed else 0
