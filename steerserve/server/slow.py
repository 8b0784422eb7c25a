"""Slow clients: a request must arrive in full (head and body) within a deadline.

uvicorn times out idle keep-alive connections only: a client that opens a connection and sends
half a request head, or trickles its body, holds a connection (and a file descriptor) forever,
400 of them as long as it likes. The protocol here closes such a connection at the deadline,
answering 408 when no response has begun (an unfinished body: the app sees a hang-up, 499).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

_BODY = (
    b'{"error":{"message":"the request did not arrive in time","type":"invalid_request_error",'
    b'"param":null,"code":"request_timeout"}}'
)
TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(_BODY), _BODY)
)


def timed_protocol(seconds: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools or h11, as it picks), with the request deadline."""

    class Timed(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
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
            elif cycle.more_body and not cycle.response_started:  # its body never did
                self.transport.close()

    return Timed
