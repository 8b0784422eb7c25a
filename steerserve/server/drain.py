"""Stopping on a signal without dropping anyone silently."""

from __future__ import annotations

import asyncio
import logging

from steerserve.server.errors import ApiError

logger = logging.getLogger("steerserve.server")

#: Seconds past the drain deadline for the dropped requests' answers to go out, before uvicorn
#: cancels what is left and EngineCore aborts its requests.
GRACE = 5


class Dropped(ApiError):
    """A request dropped at the drain deadline (or a second signal)."""

    def __init__(self) -> None:
        super().__init__(
            "the server is shutting down and dropped this request; retry it",
            status=503,
            type="service_unavailable",
            code="server_shutting_down",
        )


class Drain:
    """Whether requests in flight are dropped now, and how many were."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.count = 0
        self.reason = ""

    @property
    def dropping(self) -> bool:
        return self.event.is_set()

    def drop(self, reason: str) -> None:
        """From now on every request in flight or arriving is answered :class:`Dropped`."""
        if not self.event.is_set():
            self.reason = reason
            logger.warning("%s: dropping the requests still in flight (503)", reason)
            self.event.set()

    def error(self) -> Dropped:
        """The error of one more dropped request (counted)."""
        self.count += 1
        return Dropped()

    async def wait(self) -> None:
        await self.event.wait()

    def summary(self) -> str:
        return f"{self.count} request(s) dropped at {self.reason or 'shutdown'} (answered 503)"
