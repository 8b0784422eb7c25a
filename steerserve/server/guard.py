"""The last line of defence: an exception no handler typed becomes a 500 in OpenAI's format."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.requests import Request

from steerserve.server.errors import ApiError

logger = logging.getLogger("steerserve.server")

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]

#: The response header that carries a failed request's id (also in its error message and log).
REQUEST_ID = "x-request-id"


class Guard:
    """ASGI middleware: unhandled exceptions answer 500 (``server_error``) and are logged once;
    ``on_error(request, 500)`` counts them (the app's metrics)."""

    def __init__(
        self, app: ASGIApp, on_error: Callable[[Request, int], None] | None = None
    ) -> None:
        self.app = app
        self.on_error = on_error

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception:
            rid = f"req-{uuid.uuid4().hex[:16]}"
            method, path = scope.get("method", "?"), scope.get("path", "?")
            logger.exception("unhandled error on %s %s (request id %s)", method, path, rid)
            if self.on_error is not None:
                self.on_error(Request(scope), 500)
            if started:  # a stream already under way: it can only end here
                return
            err = ApiError(
                f"internal server error (request id {rid})", status=500, type="server_error"
            )
            body = json.dumps(err.body()).encode()
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (REQUEST_ID.encode(), rid.encode()),
            ]
            await send({"type": "http.response.start", "status": 500, "headers": headers})
            await send({"type": "http.response.body", "body": body})
