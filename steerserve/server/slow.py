"""Slow clients: a request must arrive in full (head and body) within a deadline."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from steerserve.server.errors import ApiError

_MESSAGE = "the request did not arrive in time"
_BODY = (
    b'{"error":{"message":"%s","type":"invalid_request_error",'
    b'"param":null,"code":"request_timeout"}}' % _MESSAGE.encode()
)
TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(_BODY), _BODY)
)
#: The scope key marking a request whose body missed the deadline (answered 408 already).
LATE = "steerserve.request_timeout"

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]


def late_is_408(app: ASGIApp) -> ASGIApp:
    """``app`` whose ``receive`` raises the 408 once the request is marked :data:`LATE`: the app
    counts the request it was reading as the 408 the protocol wrote, not as a client gone."""

    async def timed(scope: Scope, receive: Any, send: Any) -> None:
        async def receive_in_time() -> Any:
            message = await receive()
            if scope.get(LATE):
                raise ApiError(_MESSAGE, status=408, code="request_timeout")
            return message

        await app(scope, receive_in_time if scope["type"] == "http" else receive, send)

    return timed


def timed_protocol(seconds: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools or h11, as it picks), with the request deadline."""

    class Timed(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.app = late_is_408(self.app)

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            between = cycle is None or cycle.response_complete
            if between and (self._timer is None or self._since is not cycle):
                self._arm()  # the first bytes of another request on this connection
            super().data_received(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            super().connection_lost(exc)

        def _arm(self) -> None:
            if getattr(self, "_timer", None) is not None:
                self._timer.cancel()
            self._since = self.cycle  # the request (cycle) before the one now arriving
            self._timer = self.loop.call_later(seconds, self._expired)

        def _expired(self) -> None:
            self._timer = None
            cycle = self.cycle
            if self.transport.is_closing():
                return
            if cycle is self._since:  # its head never arrived in full
                self.transport.write(TIMEOUT_RESPONSE)
                self.transport.close()
            elif cycle.more_body:  # its body never did (answered early or not: 401, 403)
                # A request queued behind another (pipelined) would read the 408 as the answer
                # to that one: closed only, like one whose response has begun.
                if not cycle.response_started and not getattr(self, "pipeline", None):
                    cycle.scope[LATE] = True
                    self.transport.write(TIMEOUT_RESPONSE)
                # What uvicorn does once the connection is lost, now: nothing the app sends
                # reaches the closing transport, and the app waiting for the body wakes up.
                cycle.disconnected = True
                cycle.message_event.set()
                self.transport.close()

    return Timed
