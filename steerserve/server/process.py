"""The server as a process (``steerserve serve``): uvicorn, signals and the exit status."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from typing import Any

import uvicorn

from steerserve.server.app import create_app
from steerserve.server.drain import GRACE
from steerserve.server.runtime import ServerSettings
from steerserve.server.slow import timed_protocol
from steerserve.server.state import ServerState

logger = logging.getLogger("steerserve.server")


class _Server(uvicorn.Server):
    """uvicorn, told that a signal means stopping (not a dead engine); the drain deadline and a
    second signal drop what is in flight (answered), a third forces the exit."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_seconds: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_seconds = drain_seconds
        self.signals = 0

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.state.stopping = True
        self.signals += 1
        if self.signals == 1:
            super().handle_exit(sig, frame)
        elif self.signals == 2:
            self.should_exit = True
            self._drop("a second signal")
        else:
            self.force_exit = True

    def _drop(self, reason: str) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not serving yet (or any more): nothing in flight to answer
            return
        loop.call_soon_threadsafe(self.state.drain.drop, reason)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        deadline = asyncio.get_running_loop().call_later(
            self.drain_seconds,
            self.state.drain.drop,
            f"the drain deadline ({self.drain_seconds} s)",
        )
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()


def uvicorn_options(settings: ServerSettings) -> dict[str, Any]:
    """uvicorn's configuration from the server's settings (TLS and the root path under vLLM's
    names), for ``serve`` and for anyone running the app in uvicorn."""
    return {
        "host": settings.host,
        # uvicorn cancels what is left only after the dropped requests had time to be answered
        "timeout_graceful_shutdown": settings.drain_seconds + GRACE,
        "timeout_keep_alive": settings.keep_alive_seconds,
        "http": timed_protocol(settings.request_timeout_seconds),
        # X-Forwarded-For names the client only behind a proxy the operator trusts: a client
        # could otherwise pick its own address (and a fresh share of engine seats) per request
        "proxy_headers": bool(settings.forwarded_allow_ips),
        "forwarded_allow_ips": list(settings.forwarded_allow_ips) or None,
        "ssl_keyfile": settings.ssl_keyfile,
        "ssl_certfile": settings.ssl_certfile,
        "ssl_ca_certs": settings.ssl_ca_certs,
        "ssl_cert_reqs": settings.ssl_cert_reqs,
        "root_path": settings.root_path,
    }


def serve(settings: ServerSettings, port: int, log_level: str = "info") -> int:
    """Serve until stopped; the process's exit status."""
    app = create_app(settings)
    config = uvicorn.Config(
        app, port=port, log_level=log_level.lower(), **uvicorn_options(settings)
    )
    state: ServerState = app.state.steer
    server = _Server(config, state, settings.drain_seconds)
    # uvicorn re-raises a signal it drained on under the handler found at start: a no-op here,
    # so that a drained server exits with its own status instead of dying by the signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    if state.drain.count:
        logger.error("stopped: %s", state.drain.summary())
        return 1
    return 1 if state.failed else 0
